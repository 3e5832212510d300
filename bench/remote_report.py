"""The ``remote`` group's rows and docs tables (bench/remote.py): one run's report turned into
``Row``s with their goals (pace >= 0.7x the bare download, GET bytes <= 1.05x the object, first
batch <= 2 s) and into the markdown of docs/benchmarks.md (``python -m bench.remote --markdown``)."""

from __future__ import annotations

from dataclasses import dataclass

from .common import Row
from .peers import NAMES

STREAM_SHARE = 25  # stream mode's budget, percent of the file
PACE_GOAL, BYTES_GOAL, FIRST_GOAL_S = 0.7, 1.05, 2.0


@dataclass
class GoalRow(Row):
    """A row whose goal is a ceiling on the h5serve figure (bytes ratio, seconds)."""

    at_most: float | None = None

    @property
    def met(self) -> bool | None:
        if self.at_most is not None:
            return self.h5serve <= self.at_most
        return super().met

    def as_dict(self) -> dict:
        return {**super().as_dict(), "group": "remote", "at_most": self.at_most}


def limit_s(report: dict) -> float | None:
    """The bare parallel download's seconds (the ranged one: the whole GET is a report)."""
    done = [d["seconds"] for name, d in report.get("download", {}).items() if "seconds" in d and "ranges" in name]
    return min(done) if done else None


def rows(report: dict) -> list[Row]:
    size, mib = report["size"], report["mib"]
    mb = size / 1e6
    bare = limit_s(report)
    out: list[Row] = []
    what = f"{mib} MiB s3:// object on loopback moto, 2 ranks"
    for mode in ("global", "stream"):
        r = report.get(mode)
        if r is None:
            continue
        label = "global" if mode == "global" else f"stream ({STREAM_SHARE}% budget)"
        if "failed" in r:
            out.append(GoalRow(f"remote cold epoch 0, {label}, {what}: FAILED {r['failed'][:200]}", "MB/s", 0.0))
            continue
        checks = r["checks"]["failed"]
        out.append(Row(f"remote cold epoch 0 (construction to end), {label}, vs bare parallel download, {what}",
                       "MB/s", mb / r["epoch_s"], limit=mb / bare if bare else None, target=f">= {PACE_GOAL}x limit",
                       target_vs_limit=PACE_GOAL, note=f"checks: {'; '.join(checks) or 'passed'}"))
        out.append(GoalRow(f"remote GET bytes per node / file size, {label}, {what}", "x file", r["get_bytes"] / size,
                           target=f"<= {BYTES_GOAL}x", at_most=BYTES_GOAL,
                           note=f"{r['get_bytes'] / size:.3f}x; requests {r['requests']}"))
    fb = report.get("first_batch", {})
    for mode in ("stream", "global"):
        got = [(k.split()[0], v) for k, v in fb.items() if k.endswith(mode)]
        if len(got) < 2:
            continue
        (small, a), (large, b) = got[0], got[-1]
        if "failed" in a or "failed" in b:
            out.append(GoalRow(f"remote first batch, {mode}: FAILED {(a.get('failed') or b.get('failed'))[:200]}",
                               "s", 0.0))
            continue
        goal = mode == "stream"
        out.append(GoalRow(f"remote first batch from a cold object, {mode}, {large} MiB vs {small} MiB, 2 ranks"
                           + ("" if goal else " (report only: waits for the whole load)"), "s", b["first_s"],
                           a["first_s"], higher_is_better=False, target=f"<= {FIRST_GOAL_S} s" if goal else "",
                           at_most=FIRST_GOAL_S if goal else None,
                           note=f"{b['first_s'] / a['first_s']:.2f}x the time for {int(large) / int(small):g}x "
                                "the size"))
    ours = report.get("global", {})
    for system, r in report.get("peers", {}).items():
        if system not in NAMES or not isinstance(r, dict):
            continue
        if "failed" in r or "epoch_s" not in ours:
            out.append(GoalRow(f"remote cold epoch 0, h5serve global vs {NAMES[system]}, {what} (report only)", "s",
                               ours.get("epoch_s", 0.0), note=f"{NAMES[system]}: {r.get('failed', '')[:400]}"))
            continue
        out.append(GoalRow(f"remote cold epoch 0, h5serve global vs {NAMES[system]}, {what} (report only)", "s",
                           ours["epoch_s"], r["epoch_s"], higher_is_better=False,
                           note=f"{NAMES[system]}: GET {r['get_bytes'] / size:.3f}x the HDF5 file, checks "
                                f"{'; '.join(r['checks']['failed']) or 'passed'}"))
    return out


def markdown(report: dict) -> str:
    """The docs table of one run's report (``--json``)."""
    size = report["size"]
    bare = limit_s(report)
    lines = ["| reader | epoch 0 from construction (s) | MB/s | vs bare download | first batch (s) "
             "| GET bytes / file | GETs | HEADs | epoch-0 checks |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def line(name: str, r: dict) -> None:
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed'][:300]} |" + " |" * 7)
            return
        mbs = size / 1e6 / r["epoch_s"]
        lines.append(f"| {name} | {r['epoch_s']:.2f} | {mbs:.1f} | {bare / r['epoch_s'] if bare else 0:.2f}x | "
                     f"{r['first_s']:.2f} | {r['get_bytes'] / size:.3f} | {r['requests'].get('GET', 0)} | "
                     f"{r['requests'].get('HEAD', 0)} | {'; '.join(r['checks']['failed']) or 'passed'} |")

    for name, d in report.get("download", {}).items():
        if "failed" in d:
            lines.append(f"| bare s3fs download, {name} | failed: {d['failed'][:300]} |" + " |" * 7)
            continue
        lines.append(f"| bare s3fs download, {name} | {d['seconds']:.2f} | "
                     f"{size / 1e6 / d['seconds']:.1f} | {bare / d['seconds']:.2f}x | — | {d['get_bytes'] / size:.3f} "
                     f"| {d['requests'].get('GET', 0)} | {d['requests'].get('HEAD', 0)} | — |")
    for mode in ("global", "stream"):
        if mode in report:
            line(f"h5serve {mode}" + (f" ({STREAM_SHARE}% budget, {report[mode].get('block_rows')}-row blocks)"
                                      if mode == "stream" else ""), report[mode])
    for system, r in report.get("peers", {}).items():
        if system in NAMES and isinstance(r, dict):
            line(NAMES[system], r)
    timed = [(m, report[m]) for m in ("global", "stream") if "phases" in report.get(m, {})]
    if timed:
        lines += ["", "| h5serve | construction to first load (s) | loads before the first batch (s) | then to the "
                  "first batch (s) | the daemon's fetch (MB/s, all its loads) |", "|---|---:|---:|---:|---:|"]
        for mode, r in timed:
            ph, d = r["phases"], r.get("daemon", {})
            rate = f"{d['bytes_per_s'] / 1e6:.1f}" if d.get("bytes_per_s") else "—"
            lines.append(f"| {mode} | {ph['until_load_s']:.2f} | {ph['loads_s']:.2f} | {ph['after_loads_s']:.2f} | "
                         f"{rate} |")
    if report.get("first_batch"):
        lines += ["", "| object, mode | first batch from construction, cold (s) | GET bytes until then / object |",
                  "|---|---:|---:|"]
        for k, v in report["first_batch"].items():
            got = "failed" if "failed" in v else f"{v['first_s']:.2f}"
            part = f"{v['get_bytes'] / (int(k.split()[0]) << 20):.3f}" if "get_bytes" in v else "—"
            lines.append(f"| {k} | {got} | {part} |")
    return "\n".join(lines)
