"""The tasks a run can train, by the recipe's ``task`` key.

:data:`TASKS` maps each name to its :class:`~srupp.train.tasks.Task` subclass.
Importing this module imports the tasks (their data and inference helpers), not the
trainer: ``srupp generate``, ``translate`` and ``classify`` find their task here.
"""

from __future__ import annotations

from typing import Dict, Type

from ..errors import UserError
from .classify import ClassificationTask
from .lm import LMTask
from .tasks import Task
from .translate import TranslationTask

__all__ = ["TASKS", "task_named", "task_of_command"]

TASKS: Dict[str, Type[Task]] = {t.name: t for t in (LMTask, TranslationTask, ClassificationTask)}


def task_named(name: str) -> Type[Task]:
    """The task class ``name`` names; UserError naming the tasks for any other."""
    if name not in TASKS:
        raise UserError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]


def task_of_command(command: str) -> Type[Task]:
    """The task whose models ``srupp <command>`` applies to new text (``Task.command``:
    generate, translate or classify)."""
    for task in TASKS.values():
        if task.command == command:
            return task
    raise ValueError(f"no task applies its models with srupp {command!r}; commands: "
                     f"{', '.join(t.command for t in TASKS.values())}")
