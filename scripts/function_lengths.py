"""Lists the longest C++ functions under csrc/ (csrc/tests left out): lines from the first line of a
function's signature to its closing brace, in-class definitions and lambdas' enclosing functions
included (a lambda counts towards the function that holds it).

    python scripts/function_lengths.py [--top N] [--over LINES] [ROOT]

Exits 1 when --over is given and a function is longer, so a check can hold the limit.
"""
import argparse
import pathlib
import re
import sys

CONTROL = {"if", "for", "while", "switch", "catch", "do", "else", "try", "return"}
NOT_FUNCTIONS = re.compile(r"\b(namespace|class|struct|enum|union)\b")


def strip(text: str) -> str:
    """The text with comments, string and character literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path: pathlib.Path):
    """(name, first line, last line) of each outermost function body of a file."""
    # Preprocessor lines (with their continuations) are no code of a function.
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group(0)),
                  strip(path.read_text()), flags=re.M)
    stack = []  # per open brace: (is a function body, signature start offset, name)
    boundary = 0  # offset just after the last ';', '{' or '}' outside parentheses
    depth_paren = 0
    for i, c in enumerate(text):
        if c == "(":
            depth_paren += 1
        elif c == ")":
            depth_paren -= 1
        elif c == ";" and depth_paren == 0:
            boundary = i + 1
        elif c == "{":
            head = text[boundary:i]
            inside_function = any(f for f, _, _ in stack)
            is_function = False
            name = ""
            if not inside_function and "(" in head and not NOT_FUNCTIONS.search(head.split("(")[0]):
                # The name before the parameter list's '(' (skipping annotations such as REQUIRES(mu_)).
                m = re.search(r"([~\w:]+(?:<[^()]*>)?|operator\s*\S+)\s*\(", head)
                word = m.group(1).split("::")[-1] if m else ""
                if word and word not in CONTROL and not head.rstrip().endswith("="):
                    is_function, name = True, m.group(1)
            start = boundary + len(head) - len(head.lstrip())
            stack.append((is_function, start, name))
            boundary = i + 1
        elif c == "}":
            if stack:
                is_function, start, name = stack.pop()
                if is_function:
                    yield name, text.count("\n", 0, start) + 1, text.count("\n", 0, i) + 1
            boundary = i + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=str(pathlib.Path(__file__).resolve().parent.parent / "csrc"))
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--over", type=int, default=None, help="fail when a function is longer than this")
    args = parser.parse_args()
    root = pathlib.Path(args.root)
    rows = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in {".h", ".cc", ".cpp", ".cu", ".cuh"} or "tests" in path.relative_to(root).parts:
            continue
        for name, first, last in functions(path):
            rows.append((last - first + 1, f"{path.relative_to(root.parent)}:{first}", name))
    rows.sort(reverse=True)
    for lines, where, name in rows[: args.top]:
        print(f"{lines:5d}  {where:45s} {name}")
    if args.over is not None:
        longer = [r for r in rows if r[0] > args.over]
        if longer:
            print(f"{len(longer)} functions over {args.over} lines")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
