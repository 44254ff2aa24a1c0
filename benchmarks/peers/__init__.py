"""Peers of headwise run as benchmark contenders (issue 14): llama.cpp (llama_cpp.py).

Import as `from peers import llama_cpp` with benchmarks/ on sys.path, as the scripts there do
(the module name is llama-cpp-python's too; the package prefix keeps the two apart).
"""
