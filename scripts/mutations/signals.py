"""Signals: SIGHUP is a reload, not the end of pylon, and the reload re-reads what it says."""

from __future__ import annotations

from mutations.anchors import DropEntry, ReplaceExpr, ReplaceStatements
from mutations.spec import Mutation

RUN = "pylon/run.py"
SIGNALS = "pylon/signals.py"
SIGNALS_T = "tests/integration/test_signals.py"
_HUP = f"{SIGNALS_T}::test_sighup_reloads_mid_stream_and_no_other_signal_ends_pylon"
_SETS = f"{SIGNALS_T}::test_the_signal_sets_are_what_the_docs_say"
_EARLY = f"{SIGNALS_T}::test_signals_while_pylon_starts_are_acted_on_once_it_runs"
CLI = "pylon/cli.py"
_CATCH_T = "tests/unit/test_signal_catch.py"
_ONCE = f"{_CATCH_T}::test_each_signal_of_a_burst_is_acted_on_once[uvloop]"
_WAKES = f"{_CATCH_T}::test_a_stop_signal_caught_on_a_helper_thread_wakes_an_idle_loop[asyncio]"

MUTATIONS = [
    Mutation(
        "signals",
        "SIGHUP not handled (its default ends pylon mid-stream)",
        DropEntry(SIGNALS, "HANDLED", "RELOAD"),
        {"core": (_HUP, _SETS)},
    ),
    Mutation(
        "signals",
        "SIGHUP drains and stops pylon instead of reloading",
        ReplaceStatements(
            SIGNALS,
            "Signals.received",
            'self._then(self.on_reload, RELOAD, "reload")',
            "self._stop(sig)",
        ),
        {"core": (_HUP,)},
    ),
    Mutation(
        "signals",
        "SIGHUP reload does not re-read the TLS identity",
        ReplaceExpr(RUN, "Running.reload", "identity.reload()", "None"),
        {"core": (_HUP,)},
    ),
    Mutation(
        "signals",
        "SIGUSR1/SIGUSR2 not handled (their default ends pylon)",
        DropEntry(SIGNALS, "HANDLED", "*REPORT"),
        {"core": (_HUP, _SETS)},
    ),
    Mutation(
        "signals",
        "signals before the loop runs keep their defaults (end a starting pylon silently)",
        ReplaceStatements(CLI, "serve", "early.install()", "pass"),
        {"core": (_EARLY,)},
    ),
    Mutation(
        "signals",
        "signals taken through uvloop's add_signal_handler (two sources: one SIGTERM forces)",
        ReplaceStatements(
            SIGNALS,
            "Signals._install",
            "catch(loop, sig, self.received, sig)",
            "loop.add_signal_handler(sig, self.received, sig)",
        ),
        {"core": (_ONCE,)},
    ),
    Mutation(
        "signals",
        "no wakeup socket (asyncio sleeps through a signal a helper thread took)",
        ReplaceExpr(SIGNALS, "Signals.handled", "woken(loop)", "suppress()"),
        {"core": (_WAKES,)},
    ),
    Mutation(
        "signals",
        "signals held at the start are acted on as often as they came (two SIGTERMs force)",
        ReplaceExpr(SIGNALS, "EarlySignals.take", "list(dict.fromkeys(pending))", "pending"),
        {"core": (_EARLY,)},
    ),
]
