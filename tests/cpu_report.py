"""Sum a TRAINPIPE_TEST_CPU report (tests/conftest.py): ``python -m tests.cpu_report FILE [N]`` prints the total,
each module's CPU seconds and the N costliest tests."""

from __future__ import annotations

import json
import sys
from collections import Counter


def main(path: str, top: int = 30) -> None:
    tests: Counter[str] = Counter()
    walls: Counter[str] = Counter()
    with open(path) as report:
        rows = [json.loads(line) for line in report]
    for row in rows:
        tests[row["test"]] += row["cpu_s"]
        walls[row["test"]] += row["wall_s"]
    modules: Counter[str] = Counter()
    for test, cpu in tests.items():
        modules[test.split("::", 1)[0]] += cpu
    print(f"{sum(tests.values()):8.1f} CPU-s in {len(tests)} tests ({sum(walls.values()):.1f} s of wall time)")
    for module, cpu in modules.most_common():
        print(f"{cpu:8.1f}  {module}")
    print()
    for test, cpu in tests.most_common(top):
        print(f"{cpu:8.1f}  {walls[test]:6.1f} s  {test}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
