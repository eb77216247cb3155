"""The KV receiver's control-message handler under coverage-guided fuzzing (atheris; the
harness is tests/fuzz/receiver_fuzz.py), with the receiver alive and reading a synthetic AR's
registered cache over real NIXL: a bounded run here, a long one with ``make fuzz``. The
harness fails the run when a hello or read goes unanswered, a message is answered
``internal_error``, a read taken on is left behind, the receiver thread dies, the inbox exceeds
its bound or the process's memory keeps growing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "fuzz" / "receiver_fuzz.py"
FUZZ_SECONDS = 20
#: Starts the harness from a small intermediate process. Linux keeps a process's peak RSS
#: (``ru_maxrss``, what libFuzzer's ``-rss_limit_mb`` reads) across ``execve`` and seeds a
#: forked child's with its parent's current RSS, so a harness spawned straight from a pytest
#: process that has grown past 1 GiB would "start" out of memory. Its child's peak is its own.
CLEAN_RSS_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def test_fuzzing_the_receiver_finds_no_frame_that_breaks_it(tmp_path):
    seeds, corpus = tmp_path / "seeds", tmp_path / "corpus"
    corpus.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    subprocess.run([sys.executable, str(HARNESS), "--write-seeds", str(seeds)], env=env,
                   check=True, timeout=60)
    run = subprocess.run(
        [sys.executable, "-c", CLEAN_RSS_LAUNCHER,
         sys.executable, str(HARNESS), f"-max_total_time={FUZZ_SECONDS}", "-max_len=4096",
         "-rss_limit_mb=1024", "-timeout=15", "-print_final_stats=1", str(corpus), str(seeds)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_SECONDS + 40,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    done = re.search(r"Done (\d+) runs", out)
    assert done, out[-3000:]
    # Thousands of frames even on a loaded 2-core machine, and the corpus grew: coverage
    # guided the run beyond the seeds.
    assert int(done.group(1)) >= 2000, out[-2000:]
    assert len(list(corpus.iterdir())) > 5
