"""Pure tests: no daemon, no subprocess, seconds in all (`python -m pytest tests/unit`)."""
