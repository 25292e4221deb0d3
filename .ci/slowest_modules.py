"""The test modules that took longest in pytest JUnit reports: ``python .ci/slowest_modules.py
REPORT... [COUNT]`` prints the COUNT (10) slowest over all the reports (one per pytest process of
``make test``), with their total, so a CI log says where the suite's time goes."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter


def module_seconds(report_path: str) -> Counter:
    """Seconds per test module (setup, call and teardown of its tests, as pytest times them)."""
    seconds: Counter = Counter()
    for case in ElementTree.parse(report_path).iter("testcase"):
        module = case.get("classname", "").split("::")[0]
        # classname is "tests.pkg.test_mod" or "tests.pkg.test_mod.TestClass".
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        seconds[".".join(parts) or module] += float(case.get("time", 0.0))
    return seconds


def main(argv: list[str]) -> int:
    count = int(argv[-1]) if argv[-1].isdigit() else 10
    seconds: Counter = Counter()
    for report_path in (arg for arg in argv if not arg.isdigit()):
        seconds.update(module_seconds(report_path))
    total = sum(seconds.values())
    print(f"slowest {count} of {len(seconds)} test modules ({total / 60:.1f} min of tests in all):")
    for module, taken in seconds.most_common(count):
        print(f"  {taken:7.1f} s  {100 * taken / max(total, 1e-9):4.1f}%  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
