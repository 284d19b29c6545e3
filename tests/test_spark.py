"""The Spark client: docs/examples/spark_summarise.py runs in local mode (``local[2]``)
against a real ``meshd run`` daemon, with a dead peer among its entry peers (the
partitions sent there are retried on the live one), and its Parquet table and SQLite
table both equal, row for row, the same requests sent alone."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.spark import Request, _map_partition, served_model
from tests.fixtures.daemon import free_port, running_daemon
from tests.meshlab import http_json

pytest.importorskip("pyspark", reason="the spark extra (pyspark) is in the test extra")
pytest.importorskip("openai", reason="the openai SDK is in the test extra")
pq = pytest.importorskip("pyarrow.parquet")
pd = pytest.importorskip("pandas")
pytestmark = pytest.mark.timeout(240)

# A short local job: the JVM's C1 compiler alone and the serial GC start it in half the
# time on two busy cores (the pipeline is the same).
SHORT_JVM = {"JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "spark_summarise.py"
DOCS = {
    "lighthouse.txt": "The old lighthouse keeper climbed the stairs\n\nevery night,  and watched the sea.",
    "bicycle.txt": "A bicycle stays upright because the rider steers into the fall.",
    "moon.txt": "The moon is about a quarter of the size of the Earth.\nIts surface is dusty.",
    "rain.txt": "After the rain stopped, the streets of the city shone.",
    "mesh.txt": "A mesh of small machines runs one model that none of them could hold alone.",
    "empty.txt": "   \n",
}


def test_spark_example_summaries_equal_single_requests(tiny_model_dir, tmp_path):
    if shutil.which("java") is None:
        pytest.skip("pyspark needs a Java runtime (Debian: default-jre-headless)")
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    dead = f"http://127.0.0.1:{free_port()}"  # an entry peer that died: nothing listens there
    out, db = tmp_path / "summaries.parquet", tmp_path / "summaries.db"
    with running_daemon(tiny_model_dir, tmp_path / "state", tmp_path / "meshd.log", "--threads", "1") as served:
        run = subprocess.run(
            [sys.executable, str(EXAMPLE), "--docs", str(docs), "--url", served.url, "--url", dead, "--no-discover",
             "--out", str(out), "--sqlite", str(db), "--max-tokens", "12", "--partitions", "2"],
            capture_output=True, text=True, timeout=200, env=os.environ | SHORT_JVM)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        assert "summarised 5 documents through 2 peer(s) (0 failed)" in run.stdout
        assert f"meshd peer {dead} did not answer" in run.stderr  # and its partition was asked elsewhere

        parquet = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["document"])
        with sqlite3.connect(db) as conn:
            conn.row_factory = sqlite3.Row
            stored = [dict(r) for r in conn.execute("SELECT * FROM summaries ORDER BY document")]
        assert [r["document"] for r in parquet] == sorted(n for n, t in DOCS.items() if t.strip())
        assert stored == parquet
        for row in parquet:
            assert row["text"] == " ".join(DOCS[row["document"]].split())  # normalised
            body = {"messages": [{"role": "system", "content": "Summarise the document in one sentence."},
                                 {"role": "user", "content": row["text"]}], "max_tokens": 12, "temperature": 0}
            status, alone = http_json(served.url + "/v1/chat/completions", body, timeout=60)
            assert status == 200, alone
            choice = alone["choices"][0]
            assert (row["summary"], row["summary_finish_reason"], row["summary_tokens"], row["summary_error"]) == (
                choice["message"]["content"], choice["finish_reason"], alone["usage"]["completion_tokens"], None)

        # The partition function alone (pandas, no Spark): a dead first peer, an empty cell,
        # and a row the mesh refuses, whose error is that row's and does not stop the rest.
        req = Request("p", (dead, served.url), served_model([served.url]), max_tokens=4, retries=3)
        frame = pd.DataFrame({"p": ["A mesh of", None, "x " * 400, "Hello"]})
        (got,) = list(_map_partition(req, iter([frame])))
        want = http_json(served.url + "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})[1]
        assert got["completion"][3] == want["choices"][0]["text"] and got["completion_error"][3] is None
        assert got["completion_error"][1] == "no input"
        assert got["completion_error"][2].startswith("HTTP 400") and "context" in got["completion_error"][2]
        assert got["completion_tokens"][0] == 4
