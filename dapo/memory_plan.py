"""``python -m dapo.memory_plan``: the memory plan's table, the command of earlier versions.

The plan itself is :mod:`dapo.train.memory_plan` (``python -m dapo.train.memory_plan`` is the
same table); this entry point keeps the documented command working.
"""

from __future__ import annotations

from dapo.train.memory_plan import markdown_table

if __name__ == "__main__":
    print(markdown_table())
