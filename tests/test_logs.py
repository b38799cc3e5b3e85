"""ProblemLog: a repeated failure is logged once per change of state."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from gpuagent.logs import ProblemLog


def test_a_problem_is_logged_once_per_change_and_its_recovery_once() -> None:
    problems = ProblemLog(structlog.get_logger("test"))
    with capture_logs() as logs:
        problems.recovered("fine again")  # nothing was wrong: nothing to say
        problems.failed("socket gone", socket="/s")
        problems.failed("socket gone", socket="/s")
        problems.failed("refused", level="info")
        problems.recovered("fine again", n=1)
        problems.recovered("fine again", n=2)
        problems.failed("socket gone")
    assert [(e["log_level"], e["event"]) for e in logs] == [
        ("warning", "socket gone"),
        ("info", "refused"),
        ("info", "fine again"),
        ("warning", "socket gone"),
    ]
    assert logs[0]["socket"] == "/s"
    assert logs[2]["n"] == 1
    assert problems.problem == "socket gone"
