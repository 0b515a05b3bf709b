"""OpenAI-compatible server: `python server.py [--model M] [--port 8000] ...`; see `--help`."""

import sys

from api.cli import main

if __name__ == "__main__":
    sys.exit(main())
