import sys

from client.tools.gpu_check.run import main

sys.exit(main())
