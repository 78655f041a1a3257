"""Measuring scripts beside the tests (run by hand, each with its usage in its docstring); the tests
import fit_check's measured step."""
