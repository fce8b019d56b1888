"""Transport tests reuse the integration stack: real mock_dynamo and pylon on 127.0.0.1."""

from tests.integration.conftest import make_stack

__all__ = ["make_stack"]
