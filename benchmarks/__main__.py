"""Every benchmark suite, one after the other, then docs/results.md and the README headline (full) or the
comparison with the full run (quick).

    python -m benchmarks              # make bench: full runs (about an hour on 2 cores)
    python -m benchmarks --quick      # make bench-quick: some of the full run's cells again
    python -m benchmarks --suites pool http

Each suite runs in its own process (the HTTP one starts Ray) and compares its systems inside
that one process on the same prompts; see each module's docstring for what it measures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks import report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the short version of every suite")
    parser.add_argument("--suites", nargs="+", default=list(report.SUITES), choices=report.SUITES)
    args = parser.parse_args()
    durations: dict[str, float] = {}
    for number, suite in enumerate(args.suites, 1):
        print(
            f"\n== [{number}/{len(args.suites)}] benchmarks.{suite}{' --quick' if args.quick else ''}",
            flush=True,
        )
        started = time.perf_counter()
        command = [sys.executable, "-m", f"benchmarks.{suite}", *(["--quick"] if args.quick else [])]
        if subprocess.run(command, check=False).returncode != 0:
            sys.exit(f"benchmarks.{suite} failed")
        durations[suite] = time.perf_counter() - started
    print(
        "\n== time per suite: "
        + ", ".join(f"{suite} {seconds / 60:.1f} min" for suite, seconds in durations.items())
    )
    print(f"== total {sum(durations.values()) / 60:.1f} min\n")
    if args.quick:
        report.print_comparison()
    else:
        subprocess.run([sys.executable, "-m", "benchmarks.report"], check=True)


if __name__ == "__main__":
    main()
