import sys

from coreattn.selfcheck import main

sys.exit(main())
