"""spark-submit entry point for the report job (fastpubsub/spark/report.py does the work).

    spark-submit --jars /usr/share/java/postgresql.jar spark/report.py \
        --url postgresql://report@db:5432/pubsub --since 24h --out reports/

The Python that Spark runs (PYSPARK_PYTHON) needs fastpubsub installed with
its `spark` extra.
"""

import sys

from fastpubsub.spark.report import main

if __name__ == "__main__":
    sys.exit(main())
