"""`python -m aserve.entrypoints.openai.api_server [flags]`: vLLM's older way to start its OpenAI server, kept by
scripts written for it; the same as `aserve serve [flags]`."""

import sys

from aserve.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
