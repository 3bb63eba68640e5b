"""python -m tasks.loaders BENCHMARK PATH --out tasks.jsonl"""
from tasks.loaders import main

main()
