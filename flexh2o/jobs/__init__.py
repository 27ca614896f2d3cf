"""Dataset jobs: every record of an input file generated in length-sorted blocks on one loaded
engine, one result per record appended to an output that a re-run resumes.

input.py reads and checks the records; blocks.py sorts them into blocks; plans.py picks each
block shape's batch and placement; job.py runs the blocks; output.py and format.py write the
results; cli.py is `python -m flexh2o.run --input ... --output ...`.
"""
