"""The llama.cpp backend: GGUF files (the embedded models, a .gguf) on llama.cpp's CPU kernels
through llama-cpp-python's bindings (gguf.py), the weight types and threads chosen by measurement
(gguf_layout.py), each model behind runner.py (all three beside it in backends/llama_cpp/)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from cactus_cli.core.defaults import CALIBRATION_TEXT
from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends.base import Backend, Decided
from cactus_cli.infer.backends.llama_cpp import gguf, gguf_layout
from cactus_cli.infer.backends.llama_cpp.runner import LlamaCppRunner, padding
from cactus_cli.infer.load import embedded
from cactus_cli.infer.load.sources import GGUF_KINDS, LoadedModel, Source, load_tokenizer
from cactus_cli.infer.runner import Runner

PROBE_TEXT = "def add(a, b):\n    return a + b  # sum: ünïcödé, 数字 42\n\tdone!"


class LlamaCppBackend(Backend):
    name = "llama.cpp"
    summary = "GGUF files (the embedded pair, a .gguf) on the CPU with llama.cpp's kernels and the GGUF's own quantization (no conversion)"
    preferred_for = "GGUF files on a CPU"
    quantizations = tuple(gguf_layout.TYPES)  # requantized once by llama.cpp's own quantizer

    def unavailable(self) -> str | None:
        return gguf.available()

    def runs(self, src: Source) -> bool:
        return src.kind in GGUF_KINDS

    def refuses(self, request: Any, device: torch.device) -> str | None:
        for flag, on in (
            (f"--tp {request.tp}", request.tp > 1),
            ("--compile on", request.compile == "on"),
            (f"--quantize {request.quantize}", request.quantize not in ("auto", "none", *self.quantizations)),
            (f"--dtype {request.dtype}", request.dtype != "auto"),
            (f"--device {device}", device.type != "cpu"),
        ):
            if on:
                return flag
        return None

    def files(self, src: Source, reporter=None) -> tuple[Source, Source]:
        """The GGUF file itself (an embedded model's parts assembled once, no conversion) and a
        tokenizer folder made once from its vocabulary."""
        if src.kind == "embedded":
            path, key = embedded.embedded_gguf(src.location, reporter), src.location
        elif src.kind == "gguf":
            path = Path(src.location).expanduser().resolve()
            key = embedded.gguf_key(path)
        else:
            raise ModelError(
                f"{src.location}: the llama.cpp backend runs GGUF files (embedded models, .gguf), "
                f"not a {src.kind}; use --backend torch"
            )
        return Source("gguf", str(path)), Source("folder", str(embedded.gguf_tokenizer(path, key, reporter)))

    def decide(self, request: Any, src: Source, files: tuple[Source, Source], device: torch.device, reporter=None):
        tokenizer = files[1]
        texts = list(request.quality_texts or [CALIBRATION_TEXT])
        layout = gguf_layout.choose(
            Path(files[0].location),
            src.location if src.kind == "embedded" else embedded.gguf_key(files[0].location),
            request.quantize,
            request.threads,
            src.kind == "embedded",
            lambda: [list(ids) for ids in load_tokenizer(tokenizer)(texts)["input_ids"]],
            reporter,
        )
        why = "llama.cpp: the GGUF's weight types, float32 activations"
        return Decided(
            files=(Source("gguf", layout.path), files[1]),
            dtype=torch.float32,
            dtype_reason=why,
            quantize=layout.quantize,
            quantize_reason=layout.reason,
            threads=layout.threads,
            threads_reason=layout.threads_reason,
        )

    def load(self, name: str, src: Source, plan: Any, tokenizer: Any, role: str, reporter=None) -> LoadedModel:
        """A GGUF file on llama.cpp, after checking that its vocabulary gives the same ids as
        ``tokenizer`` (the engine's) on a probe text in the chat template, special tokens included."""
        t0 = time.perf_counter()
        if reporter is not None:
            reporter.task(f"loading the {role} {name} on llama.cpp")
        model = gguf.GGUFModel.load(src.location, plan.threads or gguf.default_threads())
        text = PROBE_TEXT
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": PROBE_TEXT}], add_generation_prompt=True, tokenize=False
            )
        ours, theirs = list(tokenizer(text, add_special_tokens=False)["input_ids"]), model.tokenize(text)
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ModelError(
                f"{role} {name}: llama.cpp's vocabulary and the tokenizer give different token ids for the same "
                f"text (first at token {at}: {ours[at : at + 3]} vs {theirs[at : at + 3]}); use the tokenizer "
                "made from this GGUF (no --tokenizer), or --backend torch"
            )
        return LoadedModel(
            model,
            name,
            src.location,
            torch.device("cpu"),
            torch.float32,
            model.n_ctx_train,
            model.n_vocab,
            time.perf_counter() - t0,
            plan.quantize,
            1,
            model.description,
            backend=self.name,
            threads=model.threads,
        )

    def runner(
        self, lm: LoadedModel, vocab_size: int, compiled: bool, context_length: int, role: str, sequences: int = 1
    ) -> Runner:
        runner = LlamaCppRunner(
            lm, vocab_size, context_length, sequences
        )  # (never compiled: --compile on chooses torch)
        if role == "verifier":  # (its verifies held against the measurement that chose its threads and type)
            runner.shared.watch = gguf_layout.watch_for(lm.model.path, lm.model.threads)
            if runner.shared.watch is not None:  # (calls of 2 or 3 tokens run as 4 where 4 measured cheaper)
                runner.shared.pad = padding(runner.shared.watch.curve)
        return runner

    def kv_bytes_per_token(self, lm: LoadedModel) -> int:
        ll, handle = gguf.bindings(), lm.model.handle
        heads, kv = ll.llama_model_n_head(handle), ll.llama_model_n_head_kv(handle)
        head_dim = ll.llama_model_n_embd(handle) // max(heads, 1)
        return 2 * ll.llama_model_n_layer(handle) * kv * head_dim * 2  # keys and values, float16 cells

    def cost_key(self, threads: int | None) -> dict[str, Any]:
        return {"backend": self.name, "threads": threads, "buffers": gguf.buffer_layout()}

    def environment(self, lm: LoadedModel) -> dict[str, Any]:
        return {"llama_cpp_threads": lm.threads, "llama_cpp_buffers": lm.model.buffers}

    def dtype_reason(self, plan: Any, lm: LoadedModel) -> str:
        return f"{plan.dtype_reason} ({lm.quantize_note})"  # (the GGUF's weight types: what it computes in)

    def chat_context(self, compiled: bool, device: torch.device) -> str:
        return "chat"
