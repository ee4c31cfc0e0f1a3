"""Workers' own resource samples (runtime/usage.py): a busy child process counts in its parent's CPU and memory."""

import subprocess
import sys
import time

from miles_control.job.runtime.usage import ProcessUsage, prefixed


def test_a_busy_child_counts_in_its_parents_cpu_and_memory():
    usage = ProcessUsage()
    alone = usage.sample()
    assert alone["rss_mb"] > 10 and alone["cpu_pct"] >= 0
    # a child that spins a core and holds ~200 MB
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 << 20)\nwhile True: b[0] = 1"])
    try:
        time.sleep(1.0)  # started and allocated
        usage.sample()  # the first reading of a new child is 0 %: this one starts its count
        time.sleep(1.5)
        busy = usage.sample()
    finally:
        child.kill()
        child.wait()
    assert busy["rss_mb"] > alone["rss_mb"] + 150, (alone, busy)  # the child's memory is in
    assert busy["cpu_pct"] > 40, busy  # most of a core (a shared 2-core machine: not all of it)
    after = usage.sample()
    assert after["rss_mb"] < busy["rss_mb"] - 150  # an ended child leaves the count
    assert prefixed("rollout", {"cpu_pct": 1}) == {"sys/rollout/cpu_pct": 1.0}
