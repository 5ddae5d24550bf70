import sys

from rollpacker.reward.cli import main

if __name__ == "__main__":
    sys.exit(main())
