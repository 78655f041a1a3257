"""Measuring scripts beside the tests, run by hand (each gives its usage in its docstring); no test
imports them."""
