"""Arithmetic tasks a tiny model can learn on CPU, with verifiable rewards.

- ``arithmetic``: compute an expression of ``num_operands`` integers of ``digits`` digits
  (operators drawn from ``operators``, Python precedence) with a ``calculator`` tool over
  several turns; ``<answer>N</answer>`` ends it (reward 1.0 if N is right, else 0.0).
- ``single_digit``: ``a+b=`` or ``a-b=`` whose result is one digit 0-9; the reward is 1.0
  when the first digit character anywhere in the turn is the result. A random model that
  emits digit bytes is right about one time in ten, so RL has signal from the start.

Both draw their problem from ``numpy.random.default_rng(seed)``: one seed, one problem.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from pearl.core.state import Frozen
from pearl.envs.protocol import StepResult
from pearl.envs.tools import Problem, Tool, ToolTask

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30  # the calculator refuses larger results
MAX_EXPONENT = 16
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_DIGIT = re.compile(r"\d")


class ArithmeticConfig(Frozen):
    digits: int = Field(1, ge=1, le=9, description="Digits of each operand.")
    num_operands: int = Field(2, ge=2, le=8, description="Operands in the expression.")
    operators: str = Field("+-*", description="Operators to draw from, a subset of '+-*'.")
    max_turns: int = Field(4, ge=1, le=64, description="Turns before the episode truncates.")

    @field_validator("operators")
    @classmethod
    def _known(cls, value: str) -> str:
        if not value or set(value) - set("+-*"):
            raise ValueError(f"{value!r} is not a non-empty subset of '+-*'")
        return value


class SingleDigitConfig(Frozen):
    operators: str = Field("+-", description="Operators to draw from, a subset of '+-'.")
    max_turns: int = Field(1, ge=1, le=16, description="Guesses; a wrong one says 'No.'.")

    @field_validator("operators")
    @classmethod
    def _known(cls, value: str) -> str:
        if not value or set(value) - set("+-"):
            raise ValueError(f"{value!r} is not a non-empty subset of '+-'")
        return value


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (integers, floats, + - * / // % **, parens);
    a ``ValueError`` saying what is wrong otherwise. No names, calls or attributes."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[return-value]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("result out of range")
    return value  # type: ignore[no-any-return]


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


async def _calculate(arguments: dict[str, Any]) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        return "error: arguments need a string 'expression'"
    try:
        return _format(evaluate(expression))
    except ValueError as err:
        return f"error: {err}"


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression, e.g. 3+4*2.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 3+4*2"}},
        "required": ["expression"],
    },
    run=_calculate,
)


def draw_expression(rng: np.random.Generator, config: ArithmeticConfig) -> str:
    low = 0 if config.digits == 1 else 10 ** (config.digits - 1)
    numbers = rng.integers(low, 10**config.digits, size=config.num_operands)
    ops = rng.choice(list(config.operators), size=config.num_operands - 1)
    parts = [str(numbers[0])]
    for op, n in zip(ops, numbers[1:], strict=True):
        parts += [str(op), str(n)]
    return "".join(parts)


def problem_maker(
    config: ArithmeticConfig, tool: str
) -> Callable[[np.random.Generator, dict[str, Any]], Problem]:
    """Problems of ``config``; ``options["expression"]`` sets one (tests, evaluation)."""

    def make(rng: np.random.Generator, options: dict[str, Any]) -> Problem:
        expression = options.get("expression") or draw_expression(rng, config)
        answer = int(evaluate(expression))
        text = f"Compute {expression}. Use the {tool} tool, then reply <answer>N</answer>."
        return Problem(text, answer)

    return make


def arithmetic(config: ArithmeticConfig) -> ToolTask:
    return ToolTask(problem_maker(config, "calculator"), [CALCULATOR], config.max_turns)


class SingleDigit:
    """One-digit sums and differences; the first digit of the turn is the guess."""

    system_prompt: str | None = None

    def __init__(self, config: SingleDigitConfig) -> None:
        self.config = config
        self.tools: list[dict[str, Any]] = []
        self._answer: int | None = None
        self._turns = 0

    async def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        rng = np.random.default_rng(seed)
        answer = int(rng.integers(0, 10))
        if str(rng.choice(list(self.config.operators))) == "+":
            a = int(rng.integers(0, answer + 1))
            text = f"{a}+{answer - a}="
        else:
            b = int(rng.integers(0, 10 - answer))
            text = f"{answer + b}-{b}="
        self._answer, self._turns = answer, 0
        return text, {"expected": answer, "seed": seed}

    async def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise RuntimeError("step before reset")
        self._turns += 1
        digit = _DIGIT.search(action)
        guess = None if digit is None else int(digit.group())
        correct = guess == self._answer
        info: dict[str, Any] = {"turn": self._turns, "answer": guess, "expected": self._answer}
        info["correct"] = correct
        last = self._turns >= self.config.max_turns
        if correct or (last and guess is not None):  # a digit on the last turn: an answer
            info["end_reason"] = "answered"
            return StepResult("Yes." if correct else "No.", float(correct), True, False, info)
        if last:
            info["end_reason"] = "max_turns"
        return StepResult("No.", 0.0, False, last, info)

    async def close(self) -> None:
        self._answer = None
