"""Summarise a folder of text documents with Spark and a meshd mesh; write the summaries as a
Parquet table and the same rows into a SQLite database.

    pip install 'meshd[spark]'            # pyspark, pandas, pyarrow, openai (and a Java runtime)
    python docs/examples/spark_summarise.py --docs ./notes --url http://box1:8470 \\
        --out summaries.parquet --sqlite summaries.db

The pipeline: read every file of ``--docs`` whole (one row per document), normalise the
text (whitespace collapsed, cut to ``--max-chars`` so it fits the model's context), ask
the mesh for a one-sentence summary of each (``meshd.spark.complete``: partitions spread
over the mesh's peers, found from ``--url``'s /status), and write the table. Runs in local
mode by default (``--master local[2]``); give a cluster's master URL to run it there.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys

from meshd.spark import complete, mesh_urls

SYSTEM = "Summarise the document in one sentence."
COLUMNS = ("document", "text", "summary", "summary_finish_reason", "summary_tokens", "summary_error")


def summarise(spark, docs: str, urls: list[str], max_chars: int, max_tokens: int, partitions: int):
    from pyspark.sql import functions as F

    raw = spark.read.text(docs, wholetext=True)  # one row per file
    table = raw.select(
        F.col("_metadata.file_name").alias("document"),
        F.substring(F.trim(F.regexp_replace("value", r"\s+", " ")), 1, max_chars).alias("text"),
    ).where(F.length("text") > 0).repartition(partitions)
    return complete(table, "text", urls=urls, chat=True, system=SYSTEM, output="summary", max_tokens=max_tokens,
                    temperature=0.0)


def write_sqlite(rows, path: str) -> tuple[int, int]:
    """Rows (from ``toLocalIterator``: the driver never holds the whole table) into
    ``summaries``; (rows written, rows whose request failed)."""
    db = sqlite3.connect(path)
    try:
        db.execute("CREATE TABLE IF NOT EXISTS summaries (document TEXT PRIMARY KEY, text TEXT, summary TEXT, "
                   "summary_finish_reason TEXT, summary_tokens INTEGER, summary_error TEXT)")
        n, failed, chunk = 0, 0, []
        for row in rows:
            chunk.append(tuple(row[c] for c in COLUMNS))
            failed += row["summary_error"] is not None
            if len(chunk) >= 500:
                n += _insert(db, chunk)
                chunk = []
        n += _insert(db, chunk)
        db.commit()
        return n, failed
    finally:
        db.close()


def _insert(db: sqlite3.Connection, chunk: list[tuple]) -> int:
    db.executemany(f"INSERT OR REPLACE INTO summaries VALUES ({', '.join('?' * len(COLUMNS))})", chunk)
    return len(chunk)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", required=True, help="folder of text documents")
    ap.add_argument("--url", action="append", required=True, help="a peer's API (repeatable)")
    ap.add_argument("--no-discover", action="store_true", help="use only the --url peers, not every live peer")
    ap.add_argument("--out", required=True, help="Parquet table to write")
    ap.add_argument("--sqlite", required=True, help="SQLite database to write the same rows into")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--partitions", type=int, help="default: two per peer")
    ap.add_argument("--max-chars", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    urls = list(args.url) if args.no_discover else mesh_urls(args.url[0])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this interpreter (and its meshd)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("meshd-summarise")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4").getOrCreate())
    try:
        out = summarise(spark, args.docs, urls, args.max_chars, args.max_tokens, args.partitions or 2 * len(urls))
        out = out.cache()  # asked once: Parquet and SQLite get the same answers
        out.write.mode("overwrite").parquet(args.out)
        n, failed = write_sqlite(out.toLocalIterator(), args.sqlite)
    finally:
        spark.stop()
    print(f"summarised {n} documents through {len(urls)} peer(s) ({failed} failed): {args.out}, {args.sqlite}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
