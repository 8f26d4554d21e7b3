"""lm-evaluation-harness model ``cactus``: generation through the speculative engine (so a
task's accuracy is measured with the acceptance rule in the loop, as in the paper), and
log-likelihood requests served by the verifier alone (an acceptance rule never changes scoring).

    pip install -e ".[eval]"
    cactus-lm-eval --model cactus --model_args profile=default,rule=cactus,delta=1.0 --tasks gsm8k

``cactus-lm-eval`` is lm-eval's own command line with this model registered (lm-eval 0.4.x
finds models only inside its source tree); from Python, ``import cactus_cli.app.eval.lm_eval_adapter``
registers it for ``lm_eval.simple_evaluate(model="cactus", ...)``.

model_args: ``profile`` and any profile key (``verifier``, ``draft``, ``rule``, ``delta``,
``k`` or ``num_draft_tokens``, ``max_draft_tokens``, ``device``, ``dtype``, ``quantize``,
``compile``, ``seed``, ...), and ``stats_file``: a JSONL file that gets one line per generation
request (tokens, mean acceptance length, per-token acceptance, tokens/s). Decoding follows each
task's ``gen_kwargs``: ``do_sample=false`` or ``temperature=0`` is greedy (every rule then
emits the verifier's greedy text); pass ``--gen_kwargs do_sample=true,temperature=0.6`` to
compare rules under sampling, as the paper does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

import lm_eval.models  # noqa: F401  (the built-in models: registering ours first would hide them)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from cactus_cli.app import runtime
from cactus_cli.app.config.profile_files import resolve_settings
from cactus_cli.app.config.settings import check_flags_apply, flags_to_settings, with_seed
from cactus_cli.app.session import Session
from cactus_cli.core.errors import CactusError, ContextLimitError
from cactus_cli.core.fileio import check_output_file
from cactus_cli.core.sampling import SamplingParams
from cactus_cli.core.signals import treat_sigterm_as_sigint
from cactus_cli.core.stats import SpecStats

log = logging.getLogger("cactus")
ALIASES = {"k": "num_draft_tokens"}


@register_model("cactus")
class CactusLM(LM):
    def __init__(
        self,
        profile: str | None = None,
        stats_file: str | None = None,
        batch_size: Any = None,
        max_batch_size: Any = None,
        **model_args: Any,
    ):
        super().__init__()

        device = model_args.pop("device", None)
        flags = {ALIASES.get(k, k): v for k, v in model_args.items()}
        if device is not None:
            flags["device"] = str(device)
        if flags.get("draft") in ("none", "None", ""):
            flags["draft"] = "none"
        given = flags_to_settings(**flags)
        self.settings = resolve_settings(profile, given)
        check_flags_apply(self.settings, given)  # a model_arg that would do nothing is an error
        if stats_file:
            stats_file = str(check_output_file(stats_file, "stats_file"))  # now, not at the first request
        self.settings = with_seed(self.settings)
        self.session = Session.load(settings=self.settings)
        self.session.prepare()
        self.tokenizer = self.session.tokenizer
        self.stats_file = stats_file
        self.requests_done = 0

        self.total = SpecStats()  # every generation of this run, for the log line

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> CactusLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> CactusLM:
        """lm-eval also passes its own ``device`` (``cuda:0`` by default, even on a machine without
        CUDA): a ``device`` in model_args wins, and the harness's is used only where it can work."""
        args = dict(arg_dict)
        hint = (additional_config or {}).get("device")
        if "device" not in args and hint and (not str(hint).startswith("cuda") or torch.cuda.is_available()):
            args["device"] = hint
        return cls(**args)

    # -- generation: the speculative engine --------------------------------------------------

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(gen_kwargs.get("temperature", self.settings.temperature))
            if not gen_kwargs.get("do_sample", temperature > 0) or temperature == 0:
                temperature = 0.0
            params = replace(
                runtime.generation_params(self.settings),
                max_tokens=int(gen_kwargs.get("max_gen_toks", self.settings.max_tokens)),
                stop=tuple(s for s in until if s),
                sampling=SamplingParams(
                    temperature,
                    int(gen_kwargs.get("top_k", self.settings.top_k)),
                    float(gen_kwargs.get("top_p", self.settings.top_p)),
                ),
                seed=int(self.settings.seed or 0) + self.requests_done,
            )
            ids = self._encode(context) or [self._prefix]  # an empty context still needs a token to continue
            ids = ids[-(self.session.context_length - 1) :]
            out.append(self.session.text(ids, params=params))
            self._record(self.session.stats)
            self.cache_hook.add_partial("generate_until", req.args, out[-1])
        self._log_summary()
        return out

    def _record(self, s) -> None:
        self.requests_done += 1
        self.total.merge(s)
        if self.stats_file:
            row = {
                "request": self.requests_done - 1,
                "num_output_tokens": s.num_output_tokens,
                "mean_acceptance_length": s.mean_acceptance_length,
                "per_token_acceptance": s.per_token_acceptance,
                "tokens_per_second": s.tokens_per_second,
                "finish_reason": s.finish_reason,
            }
            with open(self.stats_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def _log_summary(self) -> None:
        t = self.total
        if t.num_steps:
            log.warning(
                "cactus: %d generations, %d tokens, %.2f tok/s, %.2f tokens per verifier step, "
                "%.1f%% of drafts accepted",
                self.requests_done,
                t.num_output_tokens,
                t.tokens_per_second or 0.0,
                t.num_output_tokens / t.num_steps,
                100 * (t.draft_acceptance_rate or 0.0),
            )

    # -- scoring: the verifier alone ---------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    @property
    def _prefix(self) -> int:
        tok = self.tokenizer
        for t in (tok.bos_token_id, tok.eos_token_id):
            if t is not None:
                return int(t)
        return 0

    @torch.inference_mode()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log P(continuation | context) under the verifier (temperature 1, no filtering)."""
        limit = self.session.context_length
        n = len(continuation)
        if n > limit:
            raise ContextLimitError(
                f"a log-likelihood continuation of {n} tokens does not fit the verifier's "
                f"context window of {limit} tokens; use shorter requests or a longer-context model"
            )
        whole = (context + continuation)[-(limit + 1) :]
        logits = self.session.verifier_logits(whole[:-1], n)  # (the engine's runner: sharded under tp)
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(whole[-n:], device=logp.device)
        total = float(logp.gather(-1, target.view(-1, 1)).sum())
        return total, bool((logp.argmax(-1) == target).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            whole = self._encode(context + continuation)
            ctx = self._encode(context)
            if not ctx:
                ctx, cont = [self._prefix], whole
            else:
                cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else self._encode(continuation)
            out.append(self._score(ctx, cont) if cont else (0.0, True))
            self.cache_hook.add_partial("loglikelihood", req.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args
            total = 0.0
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(self._encode(text), self._prefix, self.session.context_length, 1),
            ):
                total += self._score(ctx, cont)[0]
            out.append(total)
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "cactus")).replace("/", "__")


def main() -> None:
    """``cactus-lm-eval``: lm-eval's command line, with the ``cactus`` model registered. A bad
    model_arg (an unknown key, a value out of range) is one line and exit 2, as in `cactus`."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    treat_sigterm_as_sigint()
    try:
        cli_evaluate()
    except CactusError as err:
        print(f"error: --model_args: {err}", file=sys.stderr)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
