"""medray's task worlds: the shared task schema and the HPO world (knowledge base, diagnosis and warm-up tasks).

``from tasks import Task, read_tasks, ensure_hpo_world``. The HPO builder is imported on first use of
``ensure_hpo_world`` so that reading tasks needs only the schema (stdlib + pydantic).
"""

from tasks.schema import Message, Task, TaskFormatError, read_tasks, write_tasks

__all__ = ["Message", "Task", "TaskFormatError", "read_tasks", "write_tasks", "ensure_hpo_world"]


def __getattr__(name: str):
    if name == "ensure_hpo_world":
        from tasks.build_hpo import ensure_hpo_world

        return ensure_hpo_world
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")
