"""Answer verifiers: numeric final answers (arithmetic, GSM8K) and countdown expressions.

Both are pure functions of text, cheap and bounded, so they run inline in the scoring process.

Numeric answers are compared as exact rationals (`fractions.Fraction`), so `12.50 == 12.5`,
`3/4 == 0.75` and `1,000 == 1000` hold without a float tolerance; a relative tolerance of 1e-9
only absorbs float spellings such as `0.30000000000000004`.

Countdown expressions are parsed with `ast` and evaluated exactly over rationals: only integer
literals, binary `+ - * /` and parentheses are allowed. Everything else (names, calls,
attributes, `**`, `//`, `%`, unary signs, floats) is rejected, and nothing is ever `eval`ed.
Each provided number may be used at most once (not necessarily all of them), the rule of the
TinyZero countdown task; duplicates in the puzzle may each be used once.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Optional

_REL_TOL = 1e-9
_MAX_EXPRESSION_CHARS = 200
"""Longer countdown answers are rejected before parsing (bounds parser time and recursion)."""

_NUMBER_RE = re.compile(
    r"(?<![\w.])"  # not the tail of a word, a number or a decimal ("10-3" ends in 3, not -3)
    r"[-+]?(?:\$\s?)?"
    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,000 or 1000, optional decimals
    r"(?:/\d+(?:\.\d+)?)?"  # simple fraction 3/4
    r"|(?<![\w.])[-+]?\.\d+"  # .5
)
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\{\s*([^{}]*?)\s*\}\{\s*([^{}]*?)\s*\}")
_CALCULATOR_RE = re.compile(r"<<[^>]*>>")


def parse_number(text: str) -> Optional[Fraction]:
    """The exact value of one number token ("$1,000.50", "-3/4", ".5"); None if it is not one."""
    s = text.replace("$", "").replace(",", "").replace(" ", "").replace("\u2212", "-")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            den_value = Fraction(den)
            return None if den_value == 0 else Fraction(num) / den_value
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _first_number(text: str) -> Optional[str]:
    match = _NUMBER_RE.search(text)
    return match.group(0) if match else None


def _last_number(text: str) -> Optional[str]:
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def _boxed_content(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return text[i:]


def _unlatex(text: str) -> str:
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\$", "$")
    text = _LATEX_FRAC_RE.sub(r"\1/\2", text)
    return text.replace("{", " ").replace("}", " ")


def extract_answer(text: str) -> Optional[str]:
    """The final-answer number token of a completion, or None.

    Priority: the first number on the first non-blank line after the last `####`; else the
    last `\\boxed{...}`; else the first number after the last "answer is" / "answer:"; else
    the last number in the text. A `####` or `\\boxed{}` that holds no number yields None (the
    model did not answer).
    """
    text = text.replace("\u2212", "-")
    pos = text.rfind("####")
    if pos >= 0:  # the first non-blank line after it: a number on a later line is not the answer
        return _first_number(text[pos + 4 :].lstrip().split("\n", 1)[0])
    boxed = _boxed_content(text)
    if boxed is not None:
        return _first_number(_unlatex(boxed))
    matches = list(_ANSWER_IS_RE.finditer(text))
    if matches:
        found = _first_number(text[matches[-1].end() :])
        if found is not None:
            return found
    return _last_number(text)


def reference_answer(answer_text: str) -> Optional[str]:
    """The final number of a reference answer: after `#### ` (GSM8K), else the whole text."""
    pos = answer_text.rfind("####")
    if pos >= 0:
        return _first_number(answer_text[pos + 4 :])
    text = answer_text.strip()
    return text if parse_number(text) is not None else None


def numbers_equal(predicted: Optional[str], reference: str) -> bool:
    """Numeric equivalence of two number tokens (exact rationals, 1e-9 relative slack)."""
    if predicted is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is None or b is None:
        return False
    return a == b or abs(a - b) <= _REL_TOL * max(abs(a), abs(b))


def numeric_vote(completion: str) -> Optional[str]:
    """The completion's final answer as a canonical number string (12, 12.0 and 24/2 alike:
    the exact rational), the key maj@n votes on; None when it has no number."""
    value = parse_number(extract_answer(completion) or "")
    return None if value is None else str(value)


def verify_numeric(completion: str, reference: str) -> bool:
    """True when the completion's final answer equals the reference number."""
    return numbers_equal(extract_answer(completion), reference)


def strip_calculator_annotations(text: str) -> str:
    """GSM8K solutions carry `<<48/2=24>>` calculator calls; drop them."""
    return _CALCULATOR_RE.sub("", text)


# ----------------------------------------------------------------------------- countdown


class _Invalid(Exception):
    pass


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant):
        if type(node.value) is not int or node.value < 0:
            raise _Invalid(f"literal {node.value!r} is not a non-negative integer")
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise _Invalid("division by zero")
            return left / right
        raise _Invalid(f"operator {type(node.op).__name__} is not allowed")
    raise _Invalid(f"{type(node).__name__} is not allowed")


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value and the integer literals of a `+ - * /` expression; ValueError if not one."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"cannot parse expression: {type(e).__name__}") from None
    used: list[int] = []
    try:
        value = _evaluate(tree, used)
    except (_Invalid, RecursionError) as e:
        raise ValueError(str(e)) from None
    return value, used


_COUNTDOWN_SYMBOLS = {"\u00d7": "*", "\\times": "*", "\\cdot": "*", "\u00f7": "/", "\\div": "/"}


def extract_expression(text: str) -> Optional[str]:
    """The final countdown expression of a completion, or None.

    Priority: the rest of the line after the last `####`; else the last `\\boxed{...}`; else
    the last `<answer>...</answer>`; else the last non-empty line. A trailing `= target` is
    dropped, as are `$` signs and a final period; `x`/`\\times`/`\\div` become `*`/`/`.
    """
    pos = text.rfind("####")
    if pos >= 0:
        candidate = text[pos + 4 :].strip().split("\n", 1)[0]
    elif (boxed := _boxed_content(text)) is not None:
        candidate = boxed
    elif (tag := text.rfind("<answer>")) >= 0:
        candidate = text[tag + len("<answer>") :].split("</answer>", 1)[0]
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            return None
        candidate = lines[-1]
    for symbol, replacement in _COUNTDOWN_SYMBOLS.items():
        candidate = candidate.replace(symbol, replacement)
    candidate = candidate.replace("$", "").split("=", 1)[0].strip().rstrip(".").strip()
    return candidate or None


def verify_countdown(completion: str, numbers: Sequence[int], target: int) -> bool:
    """True when the completion's expression uses each number at most once and equals target."""
    expression = extract_expression(completion)
    if expression is None:
        return False
    try:
        value, used = evaluate_expression(expression)
    except ValueError:
        return False
    available = Counter(int(n) for n in numbers)
    if any(count > available[n] for n, count in Counter(used).items()):
        return False
    return value == target
