"""omnidraft bench with the drafter's window set: python bw.py WINDOW <bench args...>"""
import sys
import omnidraft.drafter.drafter as dd
dd.DRAFT_WINDOW = int(sys.argv[1])
from omnidraft.cli import main
sys.exit(main(["bench", *sys.argv[2:]]))
