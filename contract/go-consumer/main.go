// A consumer of fleetline's topics written outside Python, from the published contract alone:
// the .avsc files in fleetline/schemas/ and Avro single-object encoding (C3 01, the writer
// schema's 8-byte little-endian CRC-64-AVRO fingerprint, the Avro body). It reads a topic from
// the beginning to its end as it stood when it started, decodes every message by its writer
// schema's fingerprint, prints each as a JSON line (with `--print`) and a summary line:
//
//	{"topic": ..., "messages": N, "decoded": N, "undecodable": 0, "by_schema": {...}}
//
// Usage: go run . --brokers 127.0.0.1:9092 --topic fleetline.telemetry.node --schemas ../../fleetline/schemas
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

type writerSchema struct {
	name   string
	schema avro.Schema
}

// loadSchemas parses every <Record>.v<N>.avsc and indexes it by its single-object fingerprint.
func loadSchemas(dir string) (map[uint64]writerSchema, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.avsc"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("no .avsc files in %s", dir)
	}
	known := map[uint64]writerSchema{}
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			return nil, err
		}
		// Logical types are not part of the parsing canonical form the fingerprint is taken
		// of (the Avro spec keeps only type, name, fields, symbols, items, values, size), and
		// a time read as its plain long is what fleetline's own readers use too.
		var document any
		if err := json.Unmarshal(text, &document); err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		plain, _ := json.Marshal(withoutLogicalTypes(document))
		// Each file is parsed on its own: a record's versions reuse names.
		schema, err := avro.ParseBytesWithCache(plain, "", &avro.SchemaCache{})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		fingerprint, err := schema.FingerprintUsing(avro.CRC64Avro)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		// The CRC-64-AVRO value, as the spec writes it after C3 01: little-endian.
		value := binary.BigEndian.Uint64(fingerprint)
		known[value] = writerSchema{strings.TrimSuffix(filepath.Base(file), ".avsc"), schema}
	}
	return known, nil
}

func withoutLogicalTypes(node any) any {
	switch n := node.(type) {
	case map[string]any:
		out := map[string]any{}
		for k, v := range n {
			if k != "logicalType" {
				out[k] = withoutLogicalTypes(v)
			}
		}
		return out
	case []any:
		out := make([]any, len(n))
		for i, v := range n {
			out[i] = withoutLogicalTypes(v)
		}
		return out
	}
	return node
}

func decode(known map[uint64]writerSchema, value []byte) (string, any, error) {
	if len(value) < 10 || value[0] != 0xC3 || value[1] != 0x01 {
		return "", nil, errors.New("not Avro single-object encoded")
	}
	writer, ok := known[binary.LittleEndian.Uint64(value[2:10])]
	if !ok {
		return "", nil, fmt.Errorf("unknown writer schema fingerprint %x", value[2:10])
	}
	var record any
	if err := avro.Unmarshal(writer.schema, value[10:], &record); err != nil {
		return writer.name, nil, err
	}
	return writer.name, record, nil
}

func main() {
	brokers := flag.String("brokers", "127.0.0.1:9092", "bootstrap servers, comma separated")
	topic := flag.String("topic", "", "the topic to read")
	schemas := flag.String("schemas", "../../fleetline/schemas", "the folder of .avsc files")
	print := flag.Bool("print", false, "print every decoded record as a JSON line")
	timeout := flag.Duration("timeout", 60*time.Second, "give up after this long")
	flag.Parse()
	if *topic == "" {
		fmt.Fprintln(os.Stderr, "--topic is required")
		os.Exit(2)
	}
	known, err := loadSchemas(*schemas)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	seeds := strings.Split(*brokers, ",")
	admin, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Where each partition ends now: read that far (committed messages only).
	ends, err := kadm.NewClient(admin).ListEndOffsets(ctx, *topic)
	admin.Close()
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "end offsets:", err)
		os.Exit(1)
	}
	remaining := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			remaining[o.Partition] = o.Offset
		}
	})
	client, err := kgo.NewClient(
		kgo.SeedBrokers(seeds...),
		kgo.ConsumeTopics(*topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer client.Close()
	messages, decoded := 0, 0
	bySchema := map[string]int{}
	var failures []string
	encoder := json.NewEncoder(os.Stdout)
	for len(remaining) > 0 {
		fetches := client.PollFetches(ctx)
		if ctx.Err() != nil {
			fmt.Fprintln(os.Stderr, "timed out with partitions unread:", remaining)
			os.Exit(1)
		}
		fetches.EachError(func(t string, p int32, err error) {
			fmt.Fprintf(os.Stderr, "fetch %s[%d]: %v\n", t, p, err)
		})
		fetches.EachRecord(func(r *kgo.Record) {
			end, open := remaining[r.Partition]
			if !open || r.Offset >= end {
				return
			}
			messages++
			name, record, err := decode(known, r.Value)
			if err != nil {
				failures = append(failures, fmt.Sprintf("%d@%d: %v", r.Partition, r.Offset, err))
			} else {
				decoded++
				bySchema[name]++
				if *print {
					_ = encoder.Encode(map[string]any{
						"partition": r.Partition, "offset": r.Offset, "key": string(r.Key),
						"schema": name, "record": record,
					})
				}
			}
			if r.Offset+1 >= end {
				delete(remaining, r.Partition)
			}
		})
	}
	sort.Strings(failures)
	summary := map[string]any{
		"topic": *topic, "messages": messages, "decoded": decoded,
		"undecodable": len(failures), "by_schema": bySchema, "failures": failures,
	}
	_ = encoder.Encode(map[string]any{"summary": summary})
	if len(failures) > 0 {
		os.Exit(3)
	}
}
