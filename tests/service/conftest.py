"""The service tests' shared fixtures (helpers/service.py), registered here rather than imported
by each module: the model file with the other hard mode is made once a session."""

from helpers.service import (  # noqa: F401 (fixtures)
    indexed_service,
    server,
    service,
    tiny_expected_file,
)
