"""Fixtures every test directory shares: the one real stack (`tests/stack.py`).

No pylon a test starts binds the fixed default admin port (127.0.0.1:9089): settings built in
this process take an ephemeral one unless the test chooses (`tests/stack.py` and the CLI tests
also say so explicitly), so parallel or leftover processes never collide.
"""

import os

from tests.fleet import make_fleet
from tests.stack import make_stack

os.environ.setdefault("PYLON_ADMIN_LISTEN", "127.0.0.1:0")

__all__ = ["make_fleet", "make_stack"]
