"""A pytest plugin that records each grader test's points and outcome, and writes them as JSON."""

from __future__ import annotations

import json
import os

import pytest

from exercises import REPORT_ENV


def _one_line(report: pytest.TestReport) -> str:
    """The failure's exception message, squeezed onto one line (a plain assertion or pytest.fail needs no type name)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return " ".join(text.removeprefix("AssertionError: ").removeprefix("Failed: ").split())


class PointsRecorder:
    def __init__(self) -> None:
        self.tests: dict[str, dict] = {}
        self.errors: list[str] = []

    @pytest.hookimpl
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("points")
            if marker is None or len(marker.args) != 1:
                self.errors.append(f"{item.nodeid} lacks @pytest.mark.points(n)")
                continue
            self.tests[item.nodeid] = {"name": item.name, "points": marker.args[0], "passed": False,
                                       "reason": "did not run"}

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"collecting {report.nodeid or 'tests'} failed: {_one_line(report)}")

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.get(report.nodeid)
        if test is None:
            return
        if report.when == "call" and report.passed:
            test.update(passed=True, reason="")
        elif report.failed or report.skipped:
            prefix = {"setup": "setup: ", "teardown": "teardown: "}.get(report.when, "")
            prefix = "skipped: " if report.skipped else prefix
            test.update(passed=False, reason=prefix + _one_line(report))

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        with open(os.environ[REPORT_ENV], "w") as f:
            json.dump({"tests": list(self.tests.values()), "errors": self.errors}, f)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(REPORT_ENV):
        config.pluginmanager.register(PointsRecorder(), "exercise-points")
