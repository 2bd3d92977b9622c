"""Measurements: speed and memory (`python -m h2o_chat.bench SUBCOMMAND`, cli.py), quality
(`python -m h2o_chat.bench.evaluate`), the API against llama.cpp's server
(`python -m h2o_chat.bench.api`).

One module a benchmark (decode.py, dialogue.py, ...; page.py drives the page in chromium for
panel.py), what they share in common.py, and peers/: the bridges to kvpress and llama.cpp, each
run in a venv of its own.
"""
