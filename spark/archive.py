"""spark-submit entry point for the archive job (fastpubsub/spark/archive.py does the work).

    spark-submit --jars /usr/share/java/postgresql.jar spark/archive.py \
        --url postgresql://archiver@db:5432/pubsub --out s3a://bucket/fastpubsub

The Python that Spark runs (PYSPARK_PYTHON) needs fastpubsub installed with
its `spark` extra.
"""

import sys

from fastpubsub.spark.archive import main

if __name__ == "__main__":
    sys.exit(main())
