"""`cactus serve`: the loaded pair behind an OpenAI-compatible HTTP API (app/serve/http_api.py)."""

from __future__ import annotations

import ipaddress
import signal
import sys
from typing import Annotated, Optional

import typer

from cactus_cli.app.serve.http_guard import guarded_http
from cactus_cli.cli import options as o
from cactus_cli.cli import ui
from cactus_cli.cli.edge import user_errors
from cactus_cli.core.errors import ConfigError

MAX_QUEUE = 16  # --max-queue's default


@o.shared_options(*o.GENERATION)
def serve(
    host: Annotated[
        str, typer.Option(help="The address to listen on (a non-loopback one without --api-key warns).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="The port (0: any free one, printed).")] = 8000,
    api_key: Annotated[
        Optional[str],
        typer.Option(envvar="CACTUS_API_KEY", help="Require Authorization: Bearer KEY on every request but /health."),
    ] = None,
    parallel: Annotated[
        Optional[int],
        typer.Option(
            "--parallel",
            min=1,
            max=64,
            help="Requests served at once, each in its own slot, every step verifying all of their tokens and drafts in one model call (continuous batching: a request joins at the next step and leaves when done). Default: measured here from what a verify of each width costs, said at start-up.",
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(min=1, help="Requests that may wait while --parallel are served; past it: 503 with Retry-After."),
    ] = MAX_QUEUE,
    log_requests: Annotated[
        bool,
        typer.Option(
            "--log-requests", help="Print each request's text and answer size on stderr (off: no text is logged)."
        ),
    ] = False,
    *,
    shared: o.Shared,
) -> None:
    """Serve the model pair over OpenAI's HTTP API: /v1/chat/completions, /v1/completions (streamed
    or whole), /v1/models, /health and /metrics.

    One pair is loaded once and serves --parallel requests at once (continuous batching), the rest
    waiting in arrival order in a bounded queue. Each request may set its own rule, delta, num_draft_tokens, top_k and draft (none or the
    loaded one) as extra body fields; each answer says what the speculation bought. A request
    without max_tokens generates until the end of sequence or the context window; --max-tokens N
    caps every answer at N tokens (a request asking for more is a 400). The KV caches
    keep the last request, so a request that shares its prefix skips that prefill. Ctrl-C or
    SIGTERM stops taking requests, ends the one in flight and exits 0.
    """
    with user_errors():
        try:
            import uvicorn

            from cactus_cli.app.serve.http_api import build_app
        except ImportError as err:
            raise ConfigError(
                f"cactus serve needs the serve extra ({err.name} is missing): pip install 'cactus-cli[serve]'"
            ) from None
        from cactus_cli.app import on_vllm
        from cactus_cli.app.config.profile_files import resolve_settings
        from cactus_cli.app.config.settings import check_flags_apply, with_seed
        from cactus_cli.app.serve.serving import MAX_PARALLEL, Server, available_memory, check_parallel, choose_parallel
        from cactus_cli.app.session import Session
        from cactus_cli.infer.backends.registry import drives

        settings = with_seed(resolve_settings(shared.profile, shared.flags))
        check_flags_apply(settings, shared.flags)
        _check_key(api_key)
        if drives(settings.backend):  # (vLLM's own server, with the plugin: app/on_vllm.py)
            if max_queue != MAX_QUEUE or log_requests:
                raise ConfigError(
                    "--max-queue and --log-requests are cactus serve's; --backend vllm runs vLLM's server"
                )
            err = ui.make_console(no_color=shared.no_color, stderr=True)
            return on_vllm.serve(settings, host, port, api_key, parallel, lambda line: err.print(line, markup=False))
        sock = _listen(host, port)  # (now, not after a minute of loading: a port in use is a one-line error)
        err = ui.make_console(no_color=shared.no_color, stderr=True)
        if not _loopback(host) and api_key is None:
            err.print(
                f"warning: serving on {host} without --api-key: anyone who can reach it can use it",
                markup=False,
                soft_wrap=True,
            )
        with ui.LoadProgress(err) as progress:
            # (slots: what --parallel asks, or as many as a measured default may take; at least
            # PREFIXES, whose caches keep other conversations' prefixes)
            session = Session.load(settings=settings, reporter=progress, sequences=max(parallel or MAX_PARALLEL, 4))
            session.prepare(256, progress)  # the cost probe for -k auto, before the first request
            engine = session.engine
            if parallel is None and len(engine.slots) > 1 and not engine.costs.costs.verify:
                progress.task("measuring what a verify of each width costs here (once per pair, device and dtype)")
                engine.probe_costs(settings.max_draft_tokens if settings.draft else 16)
        if parallel is None:
            parallel, why = choose_parallel(engine.costs.costs, len(engine.slots))
        else:
            why = "--parallel as given"  # (the engine was loaded with at least this many slots)
        check_parallel(parallel, engine.kv_bytes_per_token(), available_memory())
        cap = shared.flags.get("max_tokens", ...)  # (the profile's max_tokens is the CLI's default, not a cap)
        cap = None if cap is ... else cap
        server = Server(
            session,
            max_queue,
            log=(lambda line: print(line, file=sys.stderr, flush=True)) if log_requests else None,
            max_tokens=cap,
            parallel=parallel,
        )
        err.print(f"serving {server.parallel} request(s) at once: {why}", markup=False, soft_wrap=True)
        err.print(_length_note(cap, server.context_length), markup=False, soft_wrap=True)
        app = build_app(server, api_key)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5, http=guarded_http()
        )
        http = _http(config, server, err)
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn takes them while it runs, then raises them again
            signal.signal(sig, lambda *_: None)  # for the handlers it found: a stop asked for is a clean exit
        http.run(sockets=[sock])
        err.print("stopped", markup=False)


def _length_note(cap: int | None, context: int) -> str:
    if cap is None:
        return (
            f"answers without max_tokens run to their end or the {context}-token context window "
            "(--max-tokens N caps them)"
        )
    return f"answers are capped at {cap} tokens (--max-tokens); a request asking for more gets a 400"


def _check_key(key: str | None) -> None:
    if key is not None and (not key or not key.isascii() or not key.isprintable() or " " in key):
        raise ConfigError(
            "--api-key (or CACTUS_API_KEY): give a key of printable ASCII without spaces "
            "(an HTTP header carries it), or leave it out for no key"
        )


def _listen(host: str, port: int):
    """The listening socket, bound before the models load (uvicorn serves on it)."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as err:
        raise ConfigError(f"--host {host}: not an address this machine can listen on ({err})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise ConfigError(
            f"--host {host} --port {port}: cannot listen there ({err.strerror or err}); "
            + (
                "choose another --port, or 0 for any free one"
                if err.errno == errno.EADDRINUSE
                else "choose another --host"
            )
        ) from None
    return sock


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _http(config, server, console):
    """uvicorn's server, telling ours to stop (end the stream in flight, refuse the queue) when
    uvicorn is told to (Ctrl-C, SIGTERM), and saying where it listens once it does."""
    import uvicorn

    class Http(uvicorn.Server):
        def handle_exit(self, sig, frame):
            server.stop()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            for s in self.servers:
                for sock in s.sockets:
                    h, p = sock.getsockname()[:2]
                    console.print(
                        f"serving {server.model_id} on http://{h}:{p}/v1 (Ctrl-C stops)", markup=False, soft_wrap=True
                    )

    return Http(config)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
