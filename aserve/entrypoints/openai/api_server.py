"""`python -m aserve.entrypoints.openai.api_server [flags]`: vLLM's older way to start its OpenAI server, kept by
scripts written for it; runs `aserve serve [flags]`. (The command line, aserve/cli.py, sits above this package: it is
run here as a program, not imported.)"""

import runpy
import sys

if __name__ == "__main__":
    sys.argv = ["aserve", "serve", *sys.argv[1:]]
    runpy.run_module("aserve.cli", run_name="__main__", alter_sys=True)
