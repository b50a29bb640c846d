"""Train a small CNN on scikit-learn's digits (upsampled to 16x16) on a 2x2 grid.

The first conv block runs batch-parallel (each cell its own samples), the second
domain-parallel (image rows over Pr, halo exchange), then the dense layers run
model-parallel; the table printed at the end shows every layer's predicted and measured
traffic, redistributions included.

Run: python examples/digits_cnn.py   (needs: pip install "dask-ipar[train]")
"""

from distributed import Client, LocalCluster

from dask_ipar import SGD, Conv2d, Dense, Flatten, MaxPool2d, Sequential
from dask_ipar.io.data import load_digits_images


def main():
    Xtr, ytr, Xte, yte = load_digits_images(upsample=2, seed=0)  # (n, 1, 16, 16)
    with LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address="127.0.0.1:8787") as cluster, \
            Client(cluster) as client:
        print("dashboard:", client.dashboard_link)
        model = Sequential([
            Conv2d(16, 3, activation="relu", parallel="batch"), MaxPool2d(2),
            Conv2d(32, 3, activation="relu", parallel="domain"), MaxPool2d(2),
            Flatten(), Dense(128, "relu"), Dense(10),
        ], input_shape=(1, 16, 16))
        model.distribute(client, "2x2")
        history = model.fit(Xtr, ytr, epochs=10, batch_size=64,
                            optimizer=SGD(lr=0.05, momentum=0.9, weight_decay=1e-4),
                            progress=True)
        print(history.comm.table())
        print("test:", model.evaluate(Xte, yte))
        model.close()


if __name__ == "__main__":
    main()
