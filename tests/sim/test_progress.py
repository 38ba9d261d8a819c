"""The progress line, the summary table and the verdict say what happened."""

from __future__ import annotations

from rich.console import Console

from sim.progress import progress_text, summary, verdict
from sim.simulation import SimReport, SimSnapshot, SubscriberReport


def snapshot(phase: str, outstanding: int) -> SimSnapshot:
    return SimSnapshot(phase, 12.5, 3, 2, 100, 98, 2, 180, 190, outstanding, 7)


def report(lost: int, misrouted: int = 0, interrupted: bool = False) -> SimReport:
    sub = SubscriberReport(
        "site-archive-2", "lmqtt-sim-x-site-archive-2", ("site/s1/#",), True, True,
        40, 40 - lost, lost, 1, misrouted, 0, 0, 0,
    )  # fmt: skip
    return SimReport(
        "abc123", 1, 4.2, 100, 100, 0, 40 - lost, 40, lost, 1, misrouted, 0, 0, 0, interrupted,
        (sub,),
    )  # fmt: skip


def rendered(renderable: object) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_line_says_pending_while_running_and_lost_once_settled() -> None:
    running = progress_text(snapshot("publishing", 10), devices=3, subscribers=2).plain
    assert "sent 100" in running and "acked 98" in running and "received 180" in running
    assert "expected 190" in running and "pending 10" in running and "failed 2" in running
    assert "from other publishers 7" in running
    assert "lost 10" in progress_text(snapshot("done", 10), 3, 2).plain


def test_the_verdict_names_losses_and_misrouting() -> None:
    assert "OK:" in verdict(report(lost=0)).plain
    failed = verdict(report(lost=3, misrouted=2)).plain
    assert "FAILED" in failed and "3 acknowledged deliveries never arrived" in failed
    assert "2 deliveries did not match the filters" in failed
    assert "interrupted" in verdict(report(lost=0, interrupted=True)).plain
    assert report(lost=3).exit_code == 1 and report(0, interrupted=True).exit_code == 130


def test_the_summary_has_one_row_per_subscriber_with_its_session_story() -> None:
    table = rendered(summary(report(lost=3), width=200))
    assert "site-archive-2" in table and "site/s1/#" in table
    assert "persistent*" in table and "went offline and came back" in table
    narrow = rendered(summary(report(lost=3), width=80))
    assert "site/s1/#" not in narrow and "misrouted" in narrow
