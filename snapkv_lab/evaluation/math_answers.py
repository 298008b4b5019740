"""Answer checking for the reasoning sets kvpress evaluates decoding-time compression on (AIME25, MATH500).

Read at these commits (names are the files' own); written here, not copied:
- kvpress's scorers, NVIDIA/kvpress 61bbffb: evaluation/benchmarks/aime25/calculate_metrics.py:9-14 (the LAST
  \\boxed{...} of the answer, braces matched by evaluation/benchmarks/utils.py:5-19, equal as a string to the
  answer) and, at 7b43c15, evaluation/benchmarks/math500/calculate_metrics.py:7-15 (the text between the FIRST
  "boxed{" and the next "}", equal as a string). `kvpress_aime` and `kvpress_math500` below.
- MATH's grader, as PRM800K ("Let's Verify Step by Step") grades MATH500, its own 500-problem test split:
  openai/prm800k 00811d6, prm800k/grading/grader.py:234-285 `grade_answer` with its `_normalize` (105-175),
  `split_tuple` (215-231), `are_equal_under_sympy` (201-212), `should_allow_eval` (185-198), and
  prm800k/grading/math_normalize.py:8-161 (Hendrycks' MATH `_strip_string`). `math_equal` below.
  One difference: the grader turns leftover LaTeX into text with pylatexenc (grader.py:32-47); here a small
  converter handles the macros MATH answers use (\\frac, \\sqrt, \\pi, \\infty, \\cdot, \\times, \\cup, \\text,
  braces), so that no new dependency is needed. An answer with another macro keeps it, and compares as the
  grader compares an unparsed answer: by its normalized string (sympy cannot read it, so never equal by sympy).
"""

from __future__ import annotations

import re

import sympy
from sympy.parsing import sympy_parser

# ---------------------------------------------------------------------------------------------------------------
# Finding the answer


def boxed(text: str, *, last: bool = True) -> str | None:
    """The content of the last (or first) \\boxed{...} of text, nested braces matched; None when there is none or it
    never closes (kvpress's evaluation/benchmarks/utils.py:5-19)."""
    marker = "boxed{"
    start = text.rfind(marker) if last else text.find(marker)
    if start < 0:
        return None
    depth = 0
    for index in range(start + len(marker) - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + len(marker):index]
    return None


def kvpress_aime(prediction: str, references, **meta) -> float:
    """kvpress's AIME25 score: the last boxed answer equals the reference as a string."""
    return float(boxed(prediction) == str(references[0]))


def kvpress_math500(prediction: str, references, **meta) -> float:
    """kvpress's MATH500 score: the text from the first "boxed{" to the next "}" equals the reference as a string
    (no nesting: \\boxed{\\frac{1}{2}} reads as "\\frac{1")."""
    head, marker, tail = prediction.partition("boxed{")
    return float(bool(marker) and tail.split("}")[0] == str(references[0]))


def math_equal_score(prediction: str, references, **meta) -> float:
    """MATH's grader (PRM800K) on the last boxed answer against the reference."""
    return float(math_equal(boxed(prediction), str(references[0])))


# ---------------------------------------------------------------------------------------------------------------
# Hendrycks' MATH normalization (prm800k/grading/math_normalize.py)


def _braced_fracs(text: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72} (math_normalize.py:22-51)."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{"):
            out += part
        elif len(part) < 2:
            return text
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _slash_fraction(text: str) -> str:
    r"""a/b of two integers written plainly -> \frac{a}{b} (math_normalize.py:54-66)."""
    match = re.fullmatch(r"(-?\d+)/(-?\d+)", text)
    if not match or text != f"{int(match[1])}/{int(match[2])}":
        return text
    return "\\frac{" + match[1] + "}{" + match[2] + "}"


def _braced_sqrt(text: str) -> str:
    r"""\sqrt3 -> \sqrt{3} (math_normalize.py:79-91)."""
    parts = text.split("\\sqrt")
    return parts[0] + "".join("\\sqrt" + (p if p.startswith("{") else "{" + p[:1] + "}" + p[1:]) for p in parts[1:])


def math_normalize(answer: str | None) -> str | None:
    """Hendrycks' MATH normalization of an answer string (math_normalize.py:8-19 and 94-161, in its order)."""
    if answer is None:
        return None
    answer = answer.strip()
    text = re.fullmatch(r"\\text\{(?P<text>.+?)\}", answer)
    if text:
        answer = text["text"].strip()
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        answer = answer.replace(old, new)
    if "\\text{ " in answer:  # units on the right (math_normalize.py:69-76; more than one: left as it is)
        parts = answer.split("\\text{ ")
        if len(parts) != 2:
            return answer
        answer = parts[0]
    answer = answer.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not answer:
        return answer
    if answer[0] == ".":
        answer = "0" + answer
    sides = answer.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
        answer = sides[1]
    answer = _braced_fracs(_braced_sqrt(answer).replace(" ", ""))
    if answer == "0.5":
        answer = "\\frac{1}{2}"
    return _slash_fraction(answer)


# ---------------------------------------------------------------------------------------------------------------
# PRM800K's second normalization and sympy comparison (prm800k/grading/grader.py)

UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
         "foot", "feet", "inch", "yard")  # grader.py:124-143
TUPLE_CHARS = "()[]"


def _operand(text: str) -> str:
    """A fraction's part as pylatexenc writes it: bare when one number or symbol, else in parentheses."""
    return text if re.fullmatch(r"[\w.]+", text) else f"({text})"


def _latex_to_text(expr: str) -> str:
    r"""LaTeX to an expression sympy reads, for the macros MATH answers use (see module doc): \frac{a}{b} -> a/b
    (a leading space first, as grader.py:36 does for mixed numbers; parts in parentheses unless bare), \sqrt{x} ->
    sqrt(x), and so on."""
    expr = _braced_fracs(_braced_sqrt(expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")))
    group = r"\{([^{}]*)\}"
    for _ in range(8):  # innermost first, until nothing changes
        new = re.sub(r"\\frac" + group + group, lambda m: " " + _operand(m[1]) + "/" + _operand(m[2]), expr)
        new = re.sub(r"\\sqrt\[([^\]]*)\]" + group, r"(\2)**(1/(\1))", new)
        new = re.sub(r"\\sqrt" + group, r"sqrt(\1)", new)
        new = re.sub(r"\\(?:text|mathrm|mbox)" + group, r"\1", new)
        if new == expr:
            break
        expr = new
    for old, new in (("\\pi", "pi"), ("\\infty", "inf"), ("\\cup", "U"), ("\\cdot", "*"), ("\\times", "*"),
                     ("\\left", ""), ("\\right", ""), ("\\,", ""), ("\\ ", "")):
        expr = expr.replace(old, new)
    return expr.strip()


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _strip_thousands(expr: str) -> str:
    """1,000,000 -> 1000000, tuple commas kept (grader.py:94-102)."""
    while True:
        new = re.sub(r"(\d)(,)(\d\d\d)($|\D)", r"\1\3\4", expr)
        if new == expr:
            return new
        expr = new


def _int_text(text: str) -> bool:
    """Whether text reads as an integer (grader.py:69-75)."""
    try:
        value = float(_strip_thousands(text))
    except ValueError:
        return False
    return abs(value - round(value)) <= 1e-7


def _normalize(expr: str) -> str:
    """grader.py:105-175."""
    text = re.fullmatch(r"\\text\{(?P<text>.+?)\}", expr)
    if text:
        expr = text["text"]
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _int_text(expr):
        expr = str(round(float(expr)))
    if "\\" in expr:
        expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 -> 7+3/4 (grader.py:84-91)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _int_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _allowed(expr: str) -> bool:
    """Not text, nor powers sympy may hang on (grader.py:15-16, 178-198)."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return (len(letters) <= 2 and "^{" not in expr and "^(" not in expr
            and not re.search(r"\^[0-9]+\^", expr) and not re.search(r"\^[0-9][0-9]+", expr))


def _sympy_equal(truth: str, given: str) -> bool:
    """sympy simplifies truth - given to 0 (grader.py:20-29, 201-212); anything it cannot parse is not equal."""
    expr = f"({truth})-({given})"
    if not _allowed(expr):
        return False
    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        return sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)) == 0
    except Exception:  # noqa: BLE001 - the grader's own rule: an expression sympy cannot read is not equal
        return False


def _elements(expr: str) -> list[str]:
    """A tuple's or interval's elements, or [expr] (grader.py:215-231)."""
    expr = _strip_thousands(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in TUPLE_CHARS and expr[-1] in TUPLE_CHARS and \
            not any(c in expr[1:-1] for c in TUPLE_CHARS):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def _fraction(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))  # grader.py:65-66


def math_equal(given: str | None, truth: str) -> bool:
    """Whether `given` answers as `truth` under PRM800K's grader (grader.py:234-285): equal after MATH's
    normalization, or after the grader's own, or element by element (tuples, intervals) with unreduced fractions
    compared as written, integers only to integers, and the rest by sympy."""
    if given is None:
        return False
    if math_normalize(given) == math_normalize(truth):
        return True
    truth_n, given_n = _normalize(truth), _normalize(given)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truths, givens = _elements(truth_n), _elements(given_n)
    if len(truths) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # (a, b) is not [a, b]
    if len(truths) != len(givens):
        return False
    for t, g in zip(truths, givens, strict=True):
        if _fraction(t) and _fraction(g):
            equal = t == g  # an unreduced fraction is not the answer
        elif _int_text(t) != _int_text(g):
            equal = False
        else:
            equal = _sympy_equal(t, g)
        if not equal:
            return False
    return True
