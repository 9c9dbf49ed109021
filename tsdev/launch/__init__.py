"""The process launchers: what `tsdev serve` runs and the processes it starts.

    serve.py          `tsdev serve` in this process: bind, load the engine, start the API process, serve, stop
    api.py            `python -m tsdev.launch.api`: the HTTP front beside the engine process (imports no torch)
    tensor_ranks.py   `python -m tsdev.launch.tensor_ranks`: ranks 1..N-1 of `tsdev serve --tp N` (or torchrun's)
    data_parallel.py  `tsdev serve --dp N`: replicas behind one front that fans control calls out
    child.py          `tsdev serve` as a child of watch, profile, benchmarks and tests: start, wait, stop
    standby.py        `python -m tsdev.launch.standby`: a process that has imported the project, for a restart

Imports nothing here: the API process and the standby start light.
"""
