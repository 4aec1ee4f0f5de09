"""Arms that are not this harness's engines: reference implementations run in this process (external:
mlx-lm's loops, z-lab's DFlash) and engines outside it (outside: servers and subprocesses)."""
