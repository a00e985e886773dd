import sys

from autodeploy.cli.main import main

sys.exit(main())
