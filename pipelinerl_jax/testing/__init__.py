"""Test doubles that are not part of the installed runtime (`setup.py` leaves this package
out of the distribution; the tests and benchmarks import it from the source tree).

  sglang_server.py  an HTTP server speaking SGLang's /generate protocol, generating with the
                    embedded engine, with fault switches (503s, aborts, timeouts, corrupt
                    answers); every behaviour says which SGLang source it follows. Its parts:
                    sglang_state.py (what it does), sglang_faults.py (the switches),
                    sglang_process.py (`ServerProcess`: it in a child process).
  sglang_jax.py     real sglang-jax servers on CPU (venv, process) and the conformance checks.
"""
