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
