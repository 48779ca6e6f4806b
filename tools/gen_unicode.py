#!/usr/bin/env python3
"""Generates src/tok/unicode_tab.c: the Unicode character classes that the
qwen2 / qwen35 pre-tokenizer split needs.

The split only asks, of each code point, one of five questions: is it a letter
(\\p{L}), a number (\\p{N}), a mark (\\p{M}), white space (\\s), or none of these.
So the table maps every code point in [0, 0x110000) to one class and stores the
result as sorted runs (start code point, class).

Which Unicode version: the tokenizer must split text exactly as llama.cpp does,
and llama.cpp's own tables (the version our oracle runs) were made from Unicode
15.1. This script reads the Unicode Character Database text files:

  UnicodeData.txt   general category of every assigned code point
  PropList.txt      the White_Space property

from --ucd DIR (default /usr/share/unicode, Debian's `unicode-data` package,
which ships UCD 15.0.0). If the files are 15.0, the 627 code points added in
Unicode 15.1 are applied on top (listed below, from the 15.1 release notes:
four ideographic description characters, one CJK stroke, and CJK Unified
Ideographs Extension I), which gives 15.1 exactly. Without the UCD files the
script falls back to Python's unicodedata module (whatever version the
interpreter carries) and says so, because the result then differs from
llama.cpp's on characters added since that version.

Usage: python3 tools/gen_unicode.py [--ucd DIR] [--out src/tok/unicode_tab.c]
"""

import argparse
import os
import re
import sys

MAX_CP = 0x110000

# Classes, as used by src/tok/pretok.c (keep in sync with tok_internal.h).
OTHER, LETTER, NUMBER, MARK, SPACE = 0, 1, 2, 3, 4
CLASS_NAMES = ["OTHER", "LETTER", "NUMBER", "MARK", "SPACE"]


def class_of_category(gc):
    if gc[0] == "L":
        return LETTER
    if gc[0] == "N":
        return NUMBER
    if gc[0] == "M":
        return MARK
    return OTHER


# Unicode 15.1 additions (on top of 15.0): (first, last, general category).
UNICODE_15_1_ADDITIONS = [
    (0x2FFC, 0x2FFF, "So"),   # ideographic description characters
    (0x31EF, 0x31EF, "So"),   # CJK stroke HXG
    (0x2EBF0, 0x2EE5D, "Lo"), # CJK Unified Ideographs Extension I
]

# White_Space (PropList.txt) has been stable for many versions; used only when
# PropList.txt is not available.
WHITE_SPACE_FALLBACK = (list(range(0x09, 0x0E)) + [0x20, 0x85, 0xA0, 0x1680] +
                        list(range(0x2000, 0x200B)) + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


def ucd_version(ucd_dir):
    """Reads the UCD version from DerivedAge.txt or ReadMe.txt, or None."""
    for name, pat in (("DerivedAge.txt", r"DerivedAge-(\d+\.\d+\.\d+)\.txt"),
                      ("ReadMe.txt", r"Unicode(\d+\.\d+\.\d+)")):
        path = os.path.join(ucd_dir, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                m = re.search(pat, f.read(4096))
            if m:
                return m.group(1)
    return None


def categories_from_ucd(path):
    """Yields (code point, general category) for every assigned code point;
    '<..., First>' / '<..., Last>' pairs denote whole ranges."""
    first = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.rstrip("\n").split(";")
            if len(fields) < 3:
                continue
            cp, name, gc = int(fields[0], 16), fields[1], fields[2]
            if name.endswith(", First>"):
                first = cp
                continue
            if name.endswith(", Last>"):
                for c in range(first, cp + 1):
                    yield c, gc
                first = None
                continue
            yield cp, gc


def white_space_from_proplist(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line:
                continue
            rng, prop = [x.strip() for x in line.split(";")]
            if prop != "White_Space":
                continue
            if ".." in rng:
                a, b = [int(x, 16) for x in rng.split("..")]
            else:
                a = b = int(rng, 16)
            out.extend(range(a, b + 1))
    return out


def build(ucd_dir):
    cls = bytearray(MAX_CP)  # OTHER everywhere (incl. unassigned, Cn)
    data = os.path.join(ucd_dir, "UnicodeData.txt")
    props = os.path.join(ucd_dir, "PropList.txt")
    if os.path.exists(data):
        version = ucd_version(ucd_dir) or "unknown"
        for cp, gc in categories_from_ucd(data):
            cls[cp] = class_of_category(gc)
        if version.startswith("15.0"):
            for a, b, gc in UNICODE_15_1_ADDITIONS:
                for c in range(a, b + 1):
                    cls[c] = class_of_category(gc)
            version = "15.1.0 (UCD 15.0.0 + 15.1 additions)"
        elif not version.startswith("15.1"):
            print("warning: UCD %s, llama.cpp's tables are Unicode 15.1" % version,
                  file=sys.stderr)
        space = white_space_from_proplist(props) if os.path.exists(props) else WHITE_SPACE_FALLBACK
    else:
        import unicodedata
        version = unicodedata.unidata_version + " (Python unicodedata fallback)"
        print("warning: %s not found, using Python's unicodedata %s; llama.cpp's "
              "tables are Unicode 15.1" % (data, unicodedata.unidata_version), file=sys.stderr)
        for c in range(MAX_CP):
            cls[c] = class_of_category(unicodedata.category(chr(c)))
        space = WHITE_SPACE_FALLBACK
    for c in space:
        # White space is never L/N/M, so SPACE can stand as its own class.
        assert cls[c] == OTHER, hex(c)
        cls[c] = SPACE
    return cls, version


def emit(cls, version, out_path):
    runs = [(0, cls[0])]
    for c in range(1, MAX_CP):
        if cls[c] != runs[-1][1]:
            runs.append((c, cls[c]))
    lines = []
    lines.append("/* GENERATED by tools/gen_unicode.py from Unicode %s; do not edit.\n" % version)
    lines.append(" *\n")
    lines.append(" * Character classes for the pre-tokenizer split: every code point below\n")
    lines.append(" * 0x110000 belongs to the run whose start is the greatest one <= it. Each\n")
    lines.append(" * entry is (start << 3) | class, class one of KV_UC_* in tok_internal.h. */\n")
    lines.append('#include "tok/tok_internal.h"\n\n')
    lines.append("const uint32_t kv_uc_runs[] = {\n")
    row = []
    for start, k in runs:
        row.append("0x%07x" % ((start << 3) | k))
        if len(row) == 8:
            lines.append("    " + ", ".join(row) + ",\n")
            row = []
    if row:
        lines.append("    " + ", ".join(row) + ",\n")
    lines.append("};\n")
    lines.append("const size_t kv_uc_n_runs = %d;\n" % len(runs))
    with open(out_path, "w", encoding="utf-8") as f:
        f.writelines(lines)
    counts = [cls.count(k) for k in range(5)]
    print("%s: %d runs; %s" % (os.path.normpath(out_path), len(runs),
          ", ".join("%s %d" % (CLASS_NAMES[k], counts[k]) for k in range(5))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ucd", default="/usr/share/unicode")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "src", "tok", "unicode_tab.c"))
    args = ap.parse_args()
    cls, version = build(args.ucd)
    emit(cls, version, args.out)


if __name__ == "__main__":
    main()
