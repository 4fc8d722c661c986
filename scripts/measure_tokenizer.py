"""Tokenization of 1 MB of distinct text (Python standard-library sources) by spec-cli's tokenizer and by llama.cpp's
(llama-cpp-python, vocab only), on the same GGUF: seconds and whether the ids are equal.

    python scripts/measure_tokenizer.py qwen2.5-coder-0.5b gemma3-270m
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import spec_cli  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
from spec_cli.model.catalog import resolve_model
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.text.tokenizer import Tokenizer


def one_megabyte() -> str:
    parts, n = [], 0
    for f in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(f.read_text(errors="ignore"))
        n += len(parts[-1])
        if n > 1_000_000:
            break
    return "".join(parts)[:1_000_000]


def main() -> None:
    import llama_cpp  # not a dependency of spec-cli: pip install llama-cpp-python

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    text = one_megabyte()
    for name in ap.parse_args().models:
        path = str(resolve_model(name))
        tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
        llama = llama_cpp.Llama(path, vocab_only=True, verbose=False)
        t0 = time.perf_counter()
        ours = tok.encode(text, add_special=False)
        t1 = time.perf_counter()
        theirs = llama.tokenize(text.encode(), add_bos=False, special=False)
        t2 = time.perf_counter()
        print(f"{name}: {len(ours)} tokens; spec-cli {t1 - t0:.2f} s, llama.cpp {t2 - t1:.2f} s; "
              f"ids equal: {ours == theirs}")


if __name__ == "__main__":
    main()
