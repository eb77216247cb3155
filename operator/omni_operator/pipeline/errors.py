"""Errors that carry the field they are about, so a user sees what to fix."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    field: str  # a JSON path into the resource, e.g. spec.stages[1].inputs[0]
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(ValueError):
    """The resource's spec is invalid in a way the CRD schema did not (or could not) catch."""

    def __init__(self, problems: list[Problem]):
        if not problems:
            raise ValueError("SpecError needs at least one problem")
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    @property
    def fields(self) -> list[str]:
        return [p.field for p in self.problems]

    def summary(self, max_problems: int = 10, max_chars: int = 4096) -> str:
        """The first problems, in at most ``max_chars`` characters, and how many more there are:
        what a status condition or an Event says (a spec can have a thousand problems, and a
        condition's message is bounded; `omni-pipeline validate` lists them all)."""
        shown: list[str] = []
        used = 0
        for problem in self.problems[:max_problems]:
            text = str(problem)
            if shown and used + len(text) + 2 > max_chars:
                break
            shown.append(text[:max_chars])
            used += len(text) + 2
        rest = len(self.problems) - len(shown)
        return "; ".join(shown) + (f"; and {rest} more (omni-pipeline validate lists every one)" if rest else "")
