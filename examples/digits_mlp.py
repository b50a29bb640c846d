"""Train an MLP on scikit-learn's digits on a 2x2 grid and print predicted vs measured traffic.

Run: python examples/digits_mlp.py   (needs: pip install "dask-ipar[train]")
"""

from distributed import Client, LocalCluster

from dask_ipar import SGD, Dense, Sequential
from dask_ipar.io.data import load_digits_split


def main():
    Xtr, ytr, Xte, yte = load_digits_split(seed=0)
    with LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address="127.0.0.1:8787") as cluster, \
            Client(cluster) as client:
        print("dashboard:", client.dashboard_link)
        model = Sequential([Dense(128, "relu"), Dense(64, "relu"), Dense(10)], input_dim=64)
        model.distribute(client, "2x2")  # 2 model-parallel rows x 2 batch-parallel columns
        history = model.fit(Xtr, ytr, epochs=5, batch_size=64,
                            optimizer=SGD(lr=0.05, momentum=0.9, weight_decay=1e-4),
                            progress=True)
        print(history.comm.table())
        print("test:", model.evaluate(Xte, yte))
        model.close()


if __name__ == "__main__":
    main()
