"""
The measured error of ``twisted_relay.openai.counting.text_tokens``, the
input-token estimate for Chat Completions upstreams, against OpenAI's
tokenizers ``o200k_base`` and ``cl100k_base`` (tiktoken).

tiktoken fetches its BPE files from the network on first use; the npm
package ``js-tiktoken`` ships the same ranks in its ``dist/ranks``. This
script rebuilds each file from them and checks its SHA-256 against the one
tiktoken expects (so the counts are OpenAI's own), then counts::

    npm install --prefix tok js-tiktoken@1.0.21
    pip install tiktoken
    python bench/openai_counting.py --ranks tok/node_modules/js-tiktoken/dist/ranks \\
        [--prose FILE ...] [--write-fixture tests/fixtures/openai-counting.json]

The texts: the relay's own code, docs and JSON fixtures, ``git log -p`` of
its repository, the prose of ``bench/counting-prose.txt`` (twenty
languages) and of any ``--prose`` files, and random data of the kinds tool
results hold (base64, hex, UUIDs, hashes, lock files, printable ASCII,
digits, white space), cut in pieces of 2,000 to 4,000 characters. It
prints, for each kind, the least, median and largest ratio of the estimate
to the larger of the two counts, and the estimate's speed.
``--write-fixture`` writes a sample with its counts for
``tests/test_openai_counting.py``.
"""

from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

from twisted_relay.openai.counting import text_tokens  # noqa: E402

#: The SHA-256 tiktoken expects of each BPE file (tiktoken_ext/openai_public.py).
EXPECTED = {
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
}
SPECIAL = {
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
    "cl100k_base": {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                    "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
}


def encodings(ranks_dir: str) -> dict:
    """tiktoken's encodings, from js-tiktoken's ranks, each checked against OpenAI's file."""
    import tiktoken

    found = {}
    for name in EXPECTED:
        with open(os.path.join(ranks_dir, name + ".js"), encoding="utf-8") as f:
            source = f.read()
        data = json.loads(source[source.index("{"):].rstrip().rstrip(";"))
        ranks: dict[str, int] = {}
        for line in data["bpe_ranks"].split("\n"):
            if line:
                _, offset, *tokens = line.split(" ")
                for index, token in enumerate(tokens):
                    ranks[token] = int(offset) + index
        ordered = sorted(ranks.items(), key=lambda item: item[1])
        file_text = "".join("%s %d\n" % item for item in ordered)
        digest = hashlib.sha256(file_text.encode("ascii")).hexdigest()
        if digest != EXPECTED[name]:
            raise SystemExit("%s: the ranks are not OpenAI's (sha256 %s)" % (name, digest))
        found[name] = tiktoken.Encoding(
            name, pat_str=data["pat_str"], mergeable_ranks={base64.b64decode(t): r for t, r in ordered},
            special_tokens=SPECIAL[name])
    return found


def pieces(text: str, size: int, most: int) -> list[str]:
    return [text[at:at + size] for at in range(0, len(text), size)][:most]


def read(pattern: str) -> str:
    texts = []
    for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    return "".join(texts)


def prose(path: str) -> dict[str, str]:
    found: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        lang = None
        for line in f:
            if line.startswith("## "):
                lang = line[3:].strip()
                found[lang] = []
            elif lang:
                found[lang].append(line)
    return {lang: "".join(lines) for lang, lines in found.items()}


def corpus(extra_prose: list[str]) -> dict[str, list[str]]:
    rng = random.Random(7)
    log = subprocess.run(["git", "-C", ROOT, "log", "-p", "-n", "40"], capture_output=True, text=True).stdout
    texts = {
        "code": pieces(read("twisted_relay/**/*.py"), 4000, 60),
        "docs": pieces(read("docs/*.md"), 4000, 60),
        "git log -p": pieces(log, 4000, 60),
        "json": pieces(read("tests/fixtures/**/*.json") + read("tests/fixtures/**/*.sse"), 4000, 40),
        "base64": [base64.b64encode(rng.randbytes(2000)).decode() for _ in range(5)],
        "hex": [rng.randbytes(1500).hex() for _ in range(5)],
        "uuids": ["\n".join(str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(80)) for _ in range(5)],
        "sha256sum": ["\n".join("%s  src/%s.py" % (rng.randbytes(32).hex(), rng.choice(["a", "util", "main"]))
                                for _ in range(40)) for _ in range(5)],
        "lock file": ["\n".join('    "integrity": "sha512-%s",' % base64.b64encode(rng.randbytes(64)).decode()
                                for _ in range(30)) for _ in range(5)],
        "printable": ["".join(chr(rng.randrange(32, 127)) for _ in range(3000)) for _ in range(5)],
        "letters": ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3000))
                    for _ in range(3)],
        "digits": ["".join(rng.choice("0123456789") for _ in range(3000)) for _ in range(3)],
        "white space": ["\n".join(" " * rng.randrange(0, 40) + rng.choice(["x", "}", "pass"]) for _ in range(300)),
                        "\n" * 3000, " " * 3000, "\t" * 3000],
    }
    for lang, text in prose(os.path.join(ROOT, "bench", "counting-prose.txt")).items():
        texts["prose " + lang] = [text]
    for path in extra_prose:
        with open(path, encoding="utf-8") as f:
            texts["prose " + os.path.basename(path)] = pieces(f.read(), 3000, 3)
    texts["random non-ASCII"] = ["".join(chr(rng.randrange(0xA0, 0xD7FF)) for _ in range(1000)) for _ in range(3)]
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", required=True, help="js-tiktoken's dist/ranks folder")
    parser.add_argument("--prose", nargs="*", default=[], help="more prose files, UTF-8")
    parser.add_argument("--write-fixture", help="write a sample with its counts here")
    options = parser.parse_args()
    found = encodings(options.ranks)
    texts = corpus(options.prose)
    rows = []
    print("%-26s %6s %6s %6s %6s" % ("kind", "texts", "least", "median", "most"))
    for kind, items in texts.items():
        ratios = []
        for text in items:
            counts = {name: len(enc.encode(text, disallowed_special=())) for name, enc in found.items()}
            ratios.append(text_tokens(text) / max(counts.values()))
            rows.append((kind, text, counts))
        print("%-26s %6d %6.2f %6.2f %6.2f" % (kind, len(items), min(ratios), statistics.median(ratios), max(ratios)))
    code = read("twisted_relay/**/*.py")[:1_000_000]
    started = time.perf_counter()
    text_tokens(code)
    print("speed: %.2f MB/s of the relay's code" % (len(code.encode()) / 1e6 / (time.perf_counter() - started)))
    if options.write_fixture:
        write_fixture(options.write_fixture, rows, found)


def write_fixture(path: str, rows: list, found: dict) -> None:
    """
    A sample for the tests, with its counts: every fourth text of each
    kind, cut at 1,500 characters, and all of bench/counting-prose.txt;
    neither ``--prose`` files (not ours to ship) nor random non-ASCII (the
    one kind the estimate undercounts, on purpose: no text is made of it).
    """
    ours = {"prose " + lang for lang in prose(os.path.join(ROOT, "bench", "counting-prose.txt"))}
    seen: dict[str, int] = {}
    sample = []
    for kind, text, _ in rows:
        if kind == "random non-ASCII" or (kind.startswith("prose ") and kind not in ours):
            continue
        seen[kind] = seen.get(kind, -1) + 1
        if kind in ours or seen[kind] % 4 == 0:
            text = text[:1500]
            sample.append(dict({"kind": kind, "text": text}, **{
                name: len(enc.encode(text, disallowed_special=())) for name, enc in found.items()}))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(sample, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print("wrote %d texts to %s" % (len(sample), path))


if __name__ == "__main__":
    main()
