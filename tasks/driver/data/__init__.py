"""The run's data, in one place (its config section is `configs/data.py`, the sample sets `configs/*.jsonl`):
`loading` (the prompt sets: addition and colour tasks, JSONL, HF datasets; splits, each step's prompts, their
order), `files` (the Row, data-path rules, the HF datasets / verl parquet reader), `vision` (images in rows: bytes,
paths, {bytes, path}; the colours task; image checks), `checks` (the pre-flight's data checks: files, rows, prompt
lengths, images)."""
