"""The fifth round of hostile cases (``hostile_sweep.py --only fifth``): the surface added since the
fourth: slots and concurrency (``--parallel``), tool calls, JSON output, log-probabilities and the
measured choices (``cactus models remeasure``, stored conditions, garbage in the stores).

Every answer that comes back 200 is checked, not only its status: tool calls parse and validate
against their tool's schema, JSON answers that ended validate against theirs, log-probabilities are
finite, at most 0, sorted, the greedy token first, and greedy answers under concurrency equal the
same requests' answers alone. A tiny byte-level pair (every character a token, so grammars can be
kept) with a Hermes tools section in its chat template; a llama.cpp tiny GGUF for the stores.
"""

from __future__ import annotations

# The round lives beside this script: sweep_fifth_checks.py (requests and checks),
# sweep_fifth_cases_tools.py and sweep_fifth_cases_json.py (the cases), sweep_fifth_server.py
# (the pair served, the cases sent), sweep_fifth_slots.py and sweep_fifth_remeasure.py. The names
# imported `as` themselves are what sweep_sixth.py imports from here.
from pathlib import Path

from sweep_fifth_checks import TOOLS as TOOLS
from sweep_fifth_checks import chat as chat
from sweep_fifth_checks import check_calls as check_calls
from sweep_fifth_checks import fn as fn
from sweep_fifth_checks import forced as forced
from sweep_fifth_checks import logprobs_ok as logprobs_ok
from sweep_fifth_checks import no_calls as no_calls
from sweep_fifth_checks import stream_problem as stream_problem
from sweep_fifth_remeasure import cli_round
from sweep_fifth_server import make_pair, server_round


def run(hs, tmp: Path) -> None:
    models = make_pair(tmp / "fifth")
    server_round(hs, models)
    home = tmp / "fifth-home"
    home.mkdir()
    cli_round(hs, home)
