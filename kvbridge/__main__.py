import sys

from kvbridge.cli import main

sys.exit(main())
